"""Loading and the chat edge: the architectures the engine runs, and message ids appended turn by
turn that reproduce the template's own rendering."""
import pytest
import torch

import arena
import engine
import models
import rollout
from conftest import short_scenario, tiny_model


def test_turn_and_closing_ids_follow_the_template(tokenizer):
    """Appending ids message by message reproduces the template's rendering of the whole chat."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Yes?"}]
    ids = models.encode(tokenizer, models.render(tokenizer, msgs[:1], False))
    ids += models.turn_ids(tokenizer, "Hi there")
    reply = models.encode(tokenizer, "Hello") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids += reply + models.closing_ids(tokenizer, reply) + models.turn_ids(tokenizer, "Yes?")
    assert tokenizer.decode(ids) == models.render(tokenizer, msgs, True)
    cut = models.encode(tokenizer, "Hel")  # a message cut at the token limit gets the end token
    assert tokenizer.decode(cut + models.closing_ids(tokenizer, cut)) == "Hel<|im_end|>\n"




def save_folder(path, model_type, **fields):
    """A model folder holding only a config (no weights) and the tiny tokenizer."""
    from transformers import AutoConfig
    AutoConfig.for_model(model_type, **fields).save_pretrained(path)
    models.tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type, fields, named", [
    ("gemma", {}, "model_type 'gemma'"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 0, "num_hidden_layers": 2},
     "sliding attention"),
])
def test_unsupported_models_are_refused_in_one_line_before_any_weight(tmp_path, model_type,
                                                                      fields, named):
    """The folder has no weights: reaching the weight load would fail with another message."""
    folder = save_folder(tmp_path / "m", model_type, **fields)
    with pytest.raises(SystemExit) as e:
        models.load_model(folder, device="cpu")
    message = str(e.value)
    assert "\n" not in message and named in message and "cannot run on the engine" in message
    assert all(t in message for t in models.ENGINE_MODEL_TYPES + models.ENGINE_CONFIG_FIELDS)


def test_a_mistral_style_model_runs_on_the_engine(tmp_path):
    """A Mistral decoder (head_dim unlike hidden / heads) loads from a folder, and the engine's
    greedy continuation equals Hugging Face generate; a sliding window becomes the context limit."""
    model, tok = models.random_model("tiny-mistral", max_position_embeddings=2048)
    model.save_pretrained(tmp_path / "mistral")
    tok.save_pretrained(tmp_path / "mistral")
    loaded, _ = models.load_model(str(tmp_path / "mistral"), device="cpu")
    prompt = [5, 9, 14, 3, 77, 120, 8, 41, 19, 66]
    hf = loaded.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert engine.generate(loaded, [prompt], 16) == [hf]
    windowed = models.random_model("tiny-mistral", sliding_window=64,
                                   max_position_embeddings=2048)[0]
    assert engine.Engine(windowed).w["max_len"] == 64


QWEN3_STYLE_TEMPLATE = (  # ChatML framing plus Qwen3's empty think block after the generation prompt
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")


class Recording(engine.Engine):
    """An Engine that keeps each sequence's ids and the text of every context it generates from."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ids, self.contexts = {}, []

    def new(self, tokens=()):
        sid = super().new(tokens)
        self.ids[sid] = list(tokens)
        return sid

    def fork(self, sid, tokens=()):
        child = super().fork(sid, tokens)
        self.ids[child] = self.ids[sid] + list(tokens)
        return child

    def append(self, sid, tokens):
        super().append(sid, tokens)
        self.ids[sid] += list(tokens)

    def generate(self, sids, *a, **k):
        self.contexts += [self.tokenizer.decode(self.ids[s]) for s in sids]
        outs = super().generate(sids, *a, **k)
        for s, (ids, _, _) in zip(sids, outs):
            self.ids[s] += ids
        return outs


def test_a_qwen3_template_persuadee_plays_a_chatml_persuader():
    """Different tokenizers and chat templates on the two sides: each context is framed by its
    own template (the persuadee's generation prompt carries the empty think block, the
    persuader's never), and each message crosses as text, tags stripped, into the other's."""
    er_tok, ee_tok = models.tiny_tokenizer(), models.tiny_tokenizer()
    ee_tok.add_tokens(["<think>", "</think>"])
    ee_tok.chat_template = QWEN3_STYLE_TEMPLATE
    assert len(ee_tok) != len(er_tok)
    er = Recording(tiny_model("llama", seed=1), er_tok, block_size=8, num_blocks=2000)
    ee = Recording(tiny_model("qwen3", seed=2), ee_tok, block_size=8, num_blocks=2000)
    records = rollout.rollout_episodes(er, ee, [short_scenario(1), short_scenario(2)], 3,
                                       max_new_tokens=6, seed=1)
    think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ee.contexts and all(c.endswith(think) for c in ee.contexts)
    assert er.contexts and all(c.endswith("<|im_start|>assistant\n") and "<think>" not in c
                               for c in er.contexts)
    for r in records:
        assert r["outcome"] in arena.OUTCOMES and len(r["beliefs"]) == r["turns"] + 1
        for i, m in enumerate(r["transcript"]):
            if m["role"] == "persuader":
                seen = arena.persuadee_sees(m["text"])
                assert any(f"<|im_start|>user\n{seen}" in c for c in ee.contexts)
            elif i + 1 < len(r["transcript"]):  # a reply the persuader read before speaking again
                heard = arena.persuader_sees(m["text"])
                assert any(f"<|im_start|>user\n{heard}<|im_end|>\n" in c for c in er.contexts)
