"""The README's examples run: every ```python block is extracted and executed on tiny models
(each model name a snippet loads, smollm2, replaced by random:tiny-qwen3; the OpenEnv client's
against a server of a tiny persuadee started here), none holds a shell line, and the ids and
report filters the README quotes exist (a filter on a value no episode has would silently show
nothing); the page stays short, its layout names every module, and its test command is CI's. Run: python -m pytest -q tests/test_readme.py"""
import ast
import re
from pathlib import Path

import pytest

from persuarena import arena

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
TINY = "random:tiny-qwen3"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_readme_has_python_blocks_and_no_shell_inside_them():
    blocks = python_blocks()
    assert len(blocks) >= 3
    for block in blocks:
        ast.parse(block)  # a shell line (python -m ..., pip ...) is no Python
        assert not re.search(r"^\s*(python|pip|torchrun|eval|openenv) ", block, flags=re.M)


def test_the_ids_and_filters_the_readme_quotes_exist():
    ids = set(re.findall(r"\b(train-\d{4}/v\d+|heldout-\d{3})\b", README))
    known = {inst["id"] for inst in arena.training_instances()} | {
        inst["id"] for inst in arena.heldout_instances()}
    assert ids and ids <= known, ids - known
    for key, value in re.findall(r"report\.html#(?:[a-z_]+=\w+&)*([a-z_]+)=(\w+)", README) + \
            re.findall(r"report\.html#([a-z_]+)=(\w+)", README):
        vocabulary = {"domain": {s["domain"] for s in arena.load_scenarios()},
                      "outcome": set(arena.OUTCOMES)}[key]
        assert value in vocabulary, (key, value)


def test_the_readme_is_short_lists_every_file_and_runs_cis_test_command():
    """The page a newcomer reads first stays within the project's cap (~320 lines), its layout
    names every module of the method and of lab/ (a new file without a line fails here), and its
    test command is the one .ci/run runs."""
    root = Path(__file__).resolve().parent.parent
    assert len(README.splitlines()) <= 320, len(README.splitlines())
    files = [p.name for p in root.glob("*.py")] + [f"lab/{p.name}" for p in (root / "lab").iterdir()
                                                  if p.suffix in (".py", ".html", ".md")]
    missing = [f for f in files if not re.search(rf"^{re.escape(f)}[ ,]", README, flags=re.M)]
    assert not missing, missing
    assert "python -m pytest -q" in (root / ".ci" / "run").read_text()
    assert re.search(r"^python -m pytest -q  ", README, flags=re.M)


def run(block, **names):
    """A README block with its models made tiny and its names bound, executed."""
    code = block.replace('"smollm2"', repr(TINY))
    exec(compile(code, "README.md", "exec"), dict(names))


@pytest.mark.parametrize("which", ["gym.make", "load_environment"])
def test_the_in_process_snippets_run(which, capsys):
    [block] = [b for b in python_blocks() if which in b]
    run(block)
    if which == "gym.make":
        said = capsys.readouterr().out
        assert "[assistant] Hello, I'm calling about next week." in said


@pytest.mark.xdist_group("openenv")  # with test_env_server's: one worker imports openenv
def test_the_openenv_client_snippet_runs_against_a_server(tokenizer):
    from persuarena import engine
    from conftest import tiny_model
    from lab import env as persuasion_env
    from lab import sessions
    from test_env_server import serving
    [block] = [b for b in python_blocks() if "PersuArenaClient" in b]
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    hub = sessions.Hub(ee, None, t_max=2, max_new_tokens=4)
    instances = [inst for inst in arena.training_instances() if inst["id"] == "train-0001/v0"]

    def make_env():
        return persuasion_env.PersuasionEnv(scenarios=instances, hub=hub)
    with serving(make_env) as url:
        run(block.replace("http://127.0.0.1:8000", url))
    assert ee.free_blocks == 2000
