"""Shared test fixtures: tiny random models and a tokenizer built in code, nothing downloaded."""
import contextlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="trackio-"))  # not ~/.cache

# `persuarena` is this checkout's root, whatever an installed copy maps it to (the tests test
# these files): the package the method imports itself under (DECISIONS.md: One package name)
_ROOT = Path(__file__).resolve().parent.parent
if getattr(sys.modules.get("persuarena"), "__path__", [None])[0] != str(_ROOT):
    _spec = importlib.util.spec_from_file_location("persuarena", _ROOT / "__init__.py",
                                                   submodule_search_locations=[str(_ROOT)])
    sys.modules["persuarena"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["persuarena"])

import pytest
import torch

from persuarena import engine
from persuarena import models
from lab import fastpath, presets, report

os.environ[presets.CPU_BF16_ENV] = "0"  # the suite, and every process it starts, runs the cpu
# preset's float32 path on any machine, with or without bf16 units; tests of the machine's dtype
# set CPU_BF16, CPUINFO_PATH or the variable themselves (monkeypatch)
os.environ[report.FIGURES_ENV] = "0"  # evaluations write no PNGs (a third of a tiny one's time);
# a test that reads them asks for the figures fixture


@pytest.fixture
def figures(monkeypatch):
    """Evaluations written in this test (and the processes it starts) draw their PNGs."""
    monkeypatch.setenv(report.FIGURES_ENV, "1")


@pytest.fixture
def small_engine_memory(monkeypatch):
    """Engines made in this test get a 64 MiB KV pool and a 16 MiB decode memory: the bench's
    touch_memory zeroes both whole, and the defaults (2 GiB and 1 GiB) cost seconds a test."""
    monkeypatch.setattr(engine, "CACHE_GB_CPU", 1 / 16)
    monkeypatch.setattr(fastpath, "DECODE_COPY_GB", 1 / 64)


@contextlib.contextmanager
def served_app(app, **config):
    """An ASGI app under uvicorn on 127.0.0.1 (a free port) in a thread: yields its http URL and
    stops the server after (config: more uvicorn.Config settings)."""
    import uvicorn

    import warm
    port = warm.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def token_logprobs(logits, ids, temperature=1.0):
    """log softmax(logits[:, :-1] / temperature) at ids[:, 1:], float32 [B, L-1]: the reference
    the tests compare the engine's and the update's log-probs with (rpo.target_logprobs)."""
    from persuarena import rpo
    return rpo.target_logprobs(logits[:, :-1], ids[:, 1:], temperature)


def control_ids(tokenizer):
    """Every added token's id (special or not, e.g. Qwen3's <think>): the framing vocabulary."""
    return set(tokenizer.added_tokens_decoder)


def tiny_model(arch="llama", seed=0, **overrides):
    """A random decoder (~0.2M parameters, grouped-query attention) from models.RANDOM_CONFIGS,
    initialised with peaked logits so that greedy decoding has no near-ties."""
    return models.random_model(f"tiny-{arch}", seed=seed,
                                **{"max_position_embeddings": 2048, **overrides})[0]


@pytest.fixture(scope="session")
def tokenizer():
    return models.tiny_tokenizer()


# Qwen3's hybrid-thinking template, its rendering rules written out: the system turn first, a
# later system turn rendered like a user turn, an assistant message after the last user turn
# carries an (empty) think block, and with thinking disabled the generation prompt ends in one.
QWEN3_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content.split('</think>')[-1].lstrip('\\n') }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
# Llama-3's header template: begin-of-text, then each message between a role header and <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA3_CONTROL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>")


def template_tokenizer(kind):
    """A tiny tokenizer with the chat template of a model family: chatml, qwen3 or llama3."""
    if kind == "qwen3":
        return models.tiny_tokenizer(QWEN3_TEMPLATE, plain=("<think>", "</think>"))
    if kind == "llama3":
        return models.tiny_tokenizer(LLAMA3_TEMPLATE, LLAMA3_CONTROL, eos="<|eot_id|>",
                                     pad="<|end_of_text|>", bos="<|begin_of_text|>")
    return models.tiny_tokenizer()


@pytest.fixture(scope="session", params=["chatml", "qwen3", "llama3"])
def chat_tokenizer(request):
    """The tiny tokenizer under each chat template family the boundaries must hold for."""
    return template_tokenizer(request.param)


def short_scenario(i, split="train", resistance="entrenched_belief"):
    """A valid scenario with one-line fields, so tiny-model runs stay fast."""
    return {"id": f"{split}-{i:04d}", "split": split, "domain": "healthcare",
            "title": f"Flu shot {i}",
            "persuader": {"role": "nurse", "goal": "vaccinate", "request": f"get the shot on day {i}"},
            "persuadee": {"name": "Ana Ruiz", "pronouns": "she/her", "age": 40 + i,
                          "occupation": "baker", "background": "Works early shifts."},
            "context": "At the clinic desk.",
            "hidden": {"resistance": resistance, "motivation": "stay well", "concerns": ["side effects"],
                       "values": ["honesty", "family"], "trust": "medium", "relationship": "new",
                       "secret": "fainted once", "condition": "a leaflet on side effects"}}


def write_short_scenarios(folder):
    """A scenarios.jsonl of four short training and two short held-out scenarios in folder."""
    import json
    path = folder / "scenarios.jsonl"
    rows = [short_scenario(i) for i in range(1, 5)] + [short_scenario(i, "heldout") for i in (1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def short_scenarios(tmp_path):
    return write_short_scenarios(tmp_path)


# the shared tiny run's own settings: lambda 0 and sampling flags no preset has
TRAINED_RUN_FLAGS = ["--lam", "0", "--persuader-temperature", "0.9", "--persuadee-temperature",
                     "0.6", "--persuadee-top-p", "0.7", "--persuadee-top-k", "11"]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One tiny training run, shared by the tests that read a run (each copies it): one step at
    lambda 0 with its own sampling flags, a checkpoint and a held-out evaluation at step 1.
    played-sampling.json holds the (persuader, persuadee) sampling rollout received in training
    and in the evaluation. Returns (folder, its flags)."""
    import json

    from persuarena import rollout
    from persuarena import train
    root = tmp_path_factory.mktemp("trained")
    played = {}
    real = rollout.rollout_episodes

    def recording(*a, **k):
        kind = "evaluation" if k.get("on_record") else "training"
        played[kind] = [list(k["persuader_sampling"]), list(k["persuadee_sampling"])]
        return real(*a, **k)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rollout, "rollout_episodes", recording)
        train.main(["--preset", "tiny", "--judge", "none", "--scenarios", write_short_scenarios(root),
                    "--out", str(root), "--name", "run", "--steps", "1", "--save-every", "1",
                    "--eval-every", "1", "--eval-limit", "1", "--eval-t-max", "1",
                    "--max-new-tokens", "3", *TRAINED_RUN_FLAGS])
    (root / "run" / "played-sampling.json").write_text(json.dumps(played))
    return root / "run", TRAINED_RUN_FLAGS


def pytest_collection_modifyitems(items):
    """The slow tests first (a stable sort): pytest.ini's workers then finish together instead of
    one of them running the longest tests at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of pytest.ini's -n: one core each
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
    config.addinivalue_line("markers", "slow: among the slowest tests (still run by default, and "
                                       "first; -m 'not slow' leaves them out)")


PATHS = {"reference": {"FAST_PATH": False},  # engine.py alone: paged attention, plain decode
         "split+copy": {},  # the fast path on a CPU: a sequence at a time, decode over a dense copy
         "split+gather": {"DECODE_COPY_GB": 0},  # the copy would not fit: gather every step
         "padded": {"COMPUTE_BOUND_DEVICES": ()}}  # the fast path on a GPU without flash-attn


@pytest.fixture(params=list(PATHS))
def paths(request, monkeypatch):
    """Runs a test on the reference engine and once per attention path pair of the fast path
    (lab.fastpath.Batch); each knob is set in the module that owns it."""
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(engine if hasattr(engine, name) else fastpath, name, value)
    return request.param
