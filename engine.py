"""
engine.py: batched generation on a paged KV cache, in plain PyTorch. It knows no dialogue.

A context is a sequence: a block table into a shared pool plus a length. Callers create sequences,
append tokens, fork and free them through the Engine's methods; the next forward runs every
appended ("pending") token, so every token is prefilled exactly once:

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
Llama, Qwen2 and Qwen3, and tested token for token against Hugging Face `generate` on every path.

    python -m pytest -q test_engine.py       # engine tests on tiny random models
    python bench.py                          # the rollout workload against two baselines
"""
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None


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

    def append(self, sid, tokens):
        """Queue tokens at the end of a sequence; the next forward that includes it runs them."""
        self.pending[sid].extend(tokens)

    def fork(self, sid, tokens=()):
        """A child that shares the parent's cache, with `tokens` queued after it; run the
        parent's pending tokens first."""
        assert not self.pending[sid], "fork after the pending tokens have been run"
        child = self.cache.fork(sid)
        self.pending[child] = list(tokens)
        return child

    def free(self, sid):
        self.cache.free(sid)
        del self.pending[sid]

    def length(self, sid):
        """Tokens in a sequence, pending ones included."""
        return self.cache.lengths[sid] + len(self.pending[sid])

    def cached(self, sid):
        """Tokens of a sequence already in the cache."""
        return self.cache.lengths[sid]

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
# token ids in, token ids out


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


def shared_stem(seqs):
    """Length of the longest common prefix of token lists that still leaves each its last token
    (os.path.commonprefix compares any sequences element by element)."""
    return min(len(os.path.commonprefix(seqs)), min(map(len, seqs)) - 1)

