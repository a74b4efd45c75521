"""Loading and the chat edge: the architectures the engine runs, and message ids appended turn by
turn that reproduce the template's own rendering."""
import pytest
import torch

import engine
import models


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
