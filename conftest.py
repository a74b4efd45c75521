"""Shared test fixtures: tiny random models and a tokenizer built in code, nothing downloaded."""
import pytest

import engine
import models



def tiny_model(arch="llama", seed=0, **overrides):
    """A random decoder (~0.2M parameters, grouped-query attention) from models.RANDOM_CONFIGS,
    initialised with peaked logits so that greedy decoding has no near-ties."""
    return models.random_model(f"tiny-{arch}", seed=seed,
                                **{"max_position_embeddings": 2048, **overrides})[0]


@pytest.fixture(scope="session")
def tokenizer():
    return models.tiny_tokenizer()


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


@pytest.fixture
def short_scenarios(tmp_path):
    """A scenarios.jsonl of four short training and two short held-out scenarios."""
    import json
    path = tmp_path / "scenarios.jsonl"
    rows = [short_scenario(i) for i in range(1, 5)] + [short_scenario(i, "heldout") for i in (1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


PATHS = {"split+copy": {},  # a CPU's: prefill a sequence at a time, decode over a dense copy
         "split+gather": {"DECODE_COPY_GB": 0},  # the copy would not fit: gather every step
         "padded": {"COMPUTE_BOUND_DEVICES": ()}}  # a GPU's without flash-attn


@pytest.fixture(params=list(PATHS))
def paths(request, monkeypatch):
    """Runs a test once per PyTorch attention path pair (engine.Batch)."""
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(engine, name, value)
    return request.param
