"""The two levels, checked from the source: the method at the top (few, short modules that import
only torch, transformers, numpy and tqdm from outside), everything around it in lab/; imports
between modules form no circle; and every knob has one home (no module assigns another's
constant, none is derived from or aliases another's)."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "lab"
CORE_LIMITS = dict(modules=10, lines=4500, module_lines=700, train_lines=400)
CORE_THIRD_PARTY = {"torch", "transformers", "numpy", "tqdm"}
PACKAGE_MODULE_LINES = 700  # no lab module longer


def core_files():
    return sorted(p for p in ROOT.glob("*.py") if not p.name.startswith("test_")
                  and p.name not in ("conftest.py", "__init__.py"))  # __init__: the package's name


def package_files():
    return sorted((ROOT / PACKAGE).glob("*.py"))


def module_name(path):
    if path.parent.name == PACKAGE:
        return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"
    return path.stem


def project_files():
    return core_files() + package_files()


METHOD = "persuarena"  # the method's package name: `from persuarena import rpo` imports rpo


def from_module(node):
    """The module an ImportFrom names, the method's by its own name (persuarena.rpo -> rpo)."""
    return node.module.removeprefix(f"{METHOD}.") if node.module else node.module


def imported_modules(tree, own):
    """Every project-or-outside module name a file imports anywhere (function bodies included)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(from_module(node))
            if node.module == PACKAGE:  # from lab import runs
                names.update(f"{PACKAGE}.{a.name}" for a in node.names)
            if node.module == METHOD:  # from persuarena import rpo
                names.update(a.name for a in node.names)
    names.discard(own)
    return names


def import_graph():
    modules = {module_name(p): p for p in project_files()}
    graph = {}
    for name, path in modules.items():
        found = imported_modules(ast.parse(path.read_text()), name)
        graph[name] = {m for m in found if m in modules and m != PACKAGE}
    return graph


def test_the_top_level_is_the_method_within_its_budget():
    files = core_files()
    lines = {p.name: len(p.read_text().splitlines()) for p in files}
    assert len(files) <= CORE_LIMITS["modules"], sorted(lines)
    assert sum(lines.values()) <= CORE_LIMITS["lines"], lines
    assert max(lines.values()) <= CORE_LIMITS["module_lines"], lines
    assert lines["train.py"] <= CORE_LIMITS["train_lines"], lines["train.py"]


def test_no_package_module_is_over_its_budget():
    lines = {p.name: len(p.read_text().splitlines()) for p in package_files()}
    over = {name: n for name, n in lines.items() if n > PACKAGE_MODULE_LINES}
    assert not over, over


def test_the_core_imports_only_torch_transformers_numpy_and_tqdm_at_module_level():
    project = {module_name(p).split(".")[0] for p in project_files()} | {METHOD}
    for path in core_files():
        for node in ast.parse(path.read_text()).body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                assert (top in sys.stdlib_module_names or top in project or top in CORE_THIRD_PARTY), \
                    f"{path.name} imports {name} at module level"


def test_imports_form_no_circle():
    graph = import_graph()
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def project_aliases(tree):
    """{local name: project module} for every import of a project module in a file."""
    modules = {module_name(p) for p in project_files()}
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({(a.asname or a.name): a.name for a in node.names if a.name in modules})
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            aliases.update({(a.asname or a.name): f"{PACKAGE}.{a.name}" for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module == METHOD:
            aliases.update({(a.asname or a.name): a.name for a in node.names if a.name in modules})
    return aliases


def evaluated_at_import(node):
    """The nodes of an expression that run when it is evaluated (a lambda's body runs later)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.Lambda):
            yield from evaluated_at_import(child)


def is_constant(name):
    return name.isupper() and not name.startswith("_")


def test_no_module_assigns_or_derives_another_modules_constant():
    problems = []
    modules = {module_name(p) for p in project_files()}
    for path in project_files():
        tree = ast.parse(path.read_text())
        aliases = project_aliases(tree)
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in aliases and is_constant(target.attr)):
                    problems.append(f"{path.name}:{node.lineno} assigns {target.value.id}.{target.attr}")
            if isinstance(node, ast.ImportFrom) and node.level == 0 and from_module(node) in modules:
                problems += [f"{path.name}:{node.lineno} imports the constant {from_module(node)}.{a.name}"
                             for a in node.names if is_constant(a.name)]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases:
                problems.append(f"{path.name}:{node.lineno} setattr on {node.args[0].id}")
        for node in tree.body:  # module-level constants
            if not (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and is_constant(t.id)
                                                         for t in node.targets)):
                continue
            if isinstance(node.value, ast.Name) and is_constant(node.value.id):
                problems.append(f"{path.name}:{node.lineno} aliases {node.value.id}")
            for sub in evaluated_at_import(node.value):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id in aliases and is_constant(sub.attr)):
                    problems.append(f"{path.name}:{node.lineno} derives from {sub.value.id}.{sub.attr}")
    assert not problems, problems


def test_train_py_runs_from_another_folder(tmp_path):
    """`python /path/train.py --help` from another folder runs the project's own modules."""
    import subprocess
    for stray in ("rpo.py", "rollout.py"):
        (tmp_path / stray).write_text('raise SystemExit("the stray file was imported")\n')
    run = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("usage: train.py"), run.stderr


def installed_here():
    """Whether this checkout is what `persuarena` and `lab` import, installed in place
    (requirements.txt's `-e .`)."""
    import subprocess
    code = "import lab, persuarena; print(lab.__file__); print(persuarena.__file__)"
    env = {k: v for k, v in __import__("os").environ.items()}
    run = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True,
                         text=True, timeout=300)
    return run.stdout.split() == [str(ROOT / "lab" / "__init__.py"), str(ROOT / "__init__.py")]


@pytest.mark.skipif(not installed_here(), reason="this checkout is not installed in place: "
                                                  "pip install -r requirements.txt (CI's venv is)")
def test_installing_shadows_none_of_a_users_own_files(tmp_path):
    """Installed, in a folder holding its own models.py, eval.py, train.py and rpo.py (the names
    research repositories use), `import lab.env; import models` gives that folder's models (and
    so for the others), `import lab` leaves sys.path as it was, the method answers as
    persuarena.*, and `python -m lab.sweep --help` runs there."""
    import subprocess
    for own in ("models", "eval", "train", "rpo"):
        (tmp_path / f"{own}.py").write_text(f"MINE = {own!r}\n")
    code = ("import sys; before = list(sys.path); import lab; assert sys.path == before, 'moved'; "
            "import lab.env; import models, eval, train, rpo; "
            "print(models.MINE, eval.MINE, train.MINE, rpo.MINE); "
            "from persuarena import rpo as method; print(method.__file__)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.split() == ["models", "eval", "train", "rpo", str(ROOT / "rpo.py")], run.stderr
    run = subprocess.run([sys.executable, "-m", "lab.sweep", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m lab.sweep"), run.stderr


def test_pyproject_installs_two_names_of_its_own():
    """pyproject.toml installs the package persuarena (the root, its method's files) and lab,
    no top-level module; the root's modules are the method's."""
    import tomllib
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py-modules" not in setup
    assert setup["packages"] == ["persuarena", "persuarena.server", PACKAGE]
    assert setup["package-dir"] == {"persuarena": ".", "persuarena.server": "server", PACKAGE: PACKAGE}


def test_every_import_of_the_method_names_the_package():
    """No file imports a method's module by its bare name (`import rpo`): the installed project
    has none)."""
    import re
    names = "|".join(p.stem for p in core_files())
    bare = re.compile(rf"^\s*(import ({names})\b|from ({names}) import )", re.M)
    found = [f"{p.relative_to(ROOT)}" for folder in ("", PACKAGE, "tests", "server")
             for p in (ROOT / folder).glob("*.py") if bare.search(p.read_text(encoding="utf-8"))]
    assert found == []


ENTRY_POINTS = {  # each command's parser, built as its command line builds it
    "train.py": lambda: __import__("lab.cli", fromlist=["cli"]).train_args([], __import__("persuarena.train", fromlist=["train"])),
    "eval.py": lambda: __import__("persuarena.eval", fromlist=["eval"]).main([]),
    "lab.env_server": lambda: __import__("lab.env_server", fromlist=["x"]).parse_args([]),
    "lab.bench": lambda: __import__("lab.bench", fromlist=["x"]).parse_args([]),
    "lab.bench --snr": lambda: __import__("lab.bench_snr", fromlist=["x"]).snr_main([]),
    "lab.watch": lambda: __import__("lab.watch", fromlist=["x"]).main([]),
    "lab.sweep": lambda: __import__("lab.sweep", fromlist=["x"]).main([]),
    "lab.bench_sessions": lambda: __import__("lab.bench_sessions", fromlist=["x"]).main([]),
    "lab.vllm_worker": lambda: __import__("lab.vllm_worker", fromlist=["x"]).main([]),
    "lab.cpu_bf16": lambda: __import__("lab.cpu_bf16", fromlist=["x"]).main([]),
}


@pytest.mark.parametrize("command", ENTRY_POINTS)
def test_every_commands_help_explains_each_option_and_shows_its_default(command, monkeypatch):
    """Each option of each command has help text, and the help shows its default
    (lab/cli.py HelpFormatter: argparse's defaults formatter); lab.trl_grpo's is TRL's parser
    (tests/test_trl_grpo.py)."""
    import argparse

    class Built(Exception):
        pass
    built = []

    def caught(self, args=None, namespace=None):
        built.append(self)
        raise Built
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    with pytest.raises(Built):
        ENTRY_POINTS[command]()
    parser = built[-1]
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    bare = [a.option_strings[0] for a in parser._actions
            if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert bare == [], f"{command}: options without help: {bare}"
