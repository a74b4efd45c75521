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
