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
    sample  token = argmax(log p + g), g = -log(-log u) (Gumbel-max: a draw from p), with
            p = softmax(logits / T), optionally top-k / top-p truncated, and u a counter-based
            hash of (stream key, position, token id): what a sequence samples does not depend on
            the rows beside it. Its log p is recorded: log pi_old for training.
    capacity a forward reserves the blocks of its whole batch, copy-on-write included, before
            writing anything; admit() says which sequences fit.

Prefill (and probe forks) run the ragged forward (Batch): flash-attn's paged kernels when it is
installed, a GPU is present and the model is fp16/bf16 (BLOCK_SIZE divisible by 256), else
PyTorch SDPA over gathered blocks, one padded call on a GPU (never on cuDNN, whose per-shape graph
builds would cost more than the attention, layers.SDPA_BACKENDS) and one causal call a sequence on a
CPU. Decode runs on DecodeBatch: a fixed shape per batch bucket, persistent device metadata, a
dense copy of the batch's cache in the engine's one decode memory (sized once, viewed per bucket)
with a device-side mask and float32 scores, host checks every SYNC_EVERY steps, and on CUDA one
CUDA graph per bucket and sampling, captured once for the engine's life. The weights are the
model's own: q/k/v and gate/up are fused into tensors that become the parameters' storage (layers.fuse),
so nothing is held twice and a weight refresh is a write at the same addresses. The forward is
written against the Hugging Face weights of Llama, Qwen2 and Qwen3 and tested token for token
against Hugging Face `generate` on every path.

    python -m pytest -q test_engine.py       # engine tests on tiny random models
    python -m lab.bench                          # the rollout workload against two baselines
"""
import functools
import itertools
import math
import os
import time
import weakref
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

import layers

BLOCK_SIZE = 16           # tokens per KV block on the PyTorch path
FLASH_BLOCK_SIZE = 256    # ... and with flash-attn's paged kernels (their block size divides by 256)
CACHE_GB_CPU = 2.0        # KV pool size on a CPU
CACHE_FRACTION_GPU = 0.15  # share of free GPU memory given to each engine's KV pool
MAX_BLOCKS = 1 << 16      # pool size cap (small models would otherwise get millions of blocks)
COMPUTE_BOUND_DEVICES = ("cpu",)  # where compute, not kernel launches, is the cost: prefill
# attention a sequence at a time, the probes' common opening prefilled once
DECODE_COPY_GB = 1.0      # the decode memory (every decode batch's dense copy) on a CPU
DECODE_COPY_FRACTION_GPU = 0.10  # ... and its share of free memory on a GPU (train.py plans it)
SYNC_EVERY = 8            # decode steps between host checks for stop tokens (no sync per token)
BATCH_BUCKETS = (1, 2, 4, 8)  # decode batch shapes, then multiples of BATCH_STEP (nano-vllm's)
BATCH_STEP = 16
CAPACITY_BUCKET = 256     # a decode batch's capacity (tokens a row) is a multiple of this
CUDA_GRAPHS = True        # on CUDA, capture each decode bucket once as a graph and replay it
CAPACITY_TIERS = 4        # ... at this many extents (capacity / 4, / 2, 3 / 4, whole): a window
# attends over the smallest tier its rows' positions reach, not the whole capacity
DECODE_EXTENT = "live"    # eager decode steps attend up to the live length; "tier": as a graph does
DECODE_PAD = 16           # columns after a row's capacity: its scratch column, and padding that
# starts every transposed key row 32-byte aligned (cuBLAS reads aligned rows; capacity + 1 did not)
ATTENTION_CALL_MB = 256   # the padded path's largest SDPA call (mask, gathered keys, queries; call_bytes):
# a forward past it runs in several calls (whole sequences, or windows of one's queries)
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


def flash_usable(device, dtype):
    """flash-attn's paged kernels can run: installed, on CUDA, fp16 or bf16 (FlashAttention-2's)."""
    return (flash_attn_with_kvcache is not None and torch.device(device).type == "cuda"
            and dtype in (torch.float16, torch.bfloat16))


def block_size_for(device, dtype):
    """Tokens per KV block of an engine on `device` in `dtype` (before any weight loads)."""
    return FLASH_BLOCK_SIZE if flash_usable(device, dtype) else BLOCK_SIZE


class Sampling(NamedTuple):
    """How a role samples. Temperature 0 is greedy; top_p / top_k truncate the distribution (for
    the frozen roles: the persuader samples the whole tempered distribution, so that the
    log-probs it records are exactly pi_old)."""
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None


GREEDY = Sampling()
MASK32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit avalanche hash of int64 tensors holding 32-bit values (odd multipliers below
    2**31, so no product leaves int64)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def stream_key(*parts):
    """The 32-bit key of one random stream, from any parts (seed, instance id, group index, side)."""
    return zlib.crc32(repr(parts).encode())


def uniform_noise(keys, positions, vocab, ids=None):
    """u in (0, 1) for every (row, token id): a pure function of the row's stream key, the
    position the sampled token will take and the id (counter-based, 24 bits). A sequence's draws
    therefore never depend on the rows beside it, the pool, the admission order or the ranks.
    ids [rows, n]: the noise of those ids only (the same values), else of every id below vocab."""
    base = mix32(mix32(keys & MASK32) ^ (positions & MASK32))
    ids = torch.arange(vocab, device=keys.device) if ids is None else ids
    x = mix32((base[:, None] + ids) & MASK32)
    return ((x >> 8).float() + 0.5) * 2.0 ** -24


def sample(logits, sampling, keys, positions):
    """Next tokens and their log-probs under the distribution actually sampled from.

    Gumbel-max: argmax(log p + g), g = -log(-log u), draws exactly from p; p is softmax(logits / T),
    restricted to the top_k ids and to the smallest set of mass >= top_p when those are given.
    With top_k, the truncation, top-p's sort and the noise touch the k candidates only (the
    noise of an id is the same whichever ids are drawn, uniform_noise)."""
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    logp, ids = torch.log_softmax(logits / sampling.temperature, -1), None
    if sampling.top_k:  # the k largest, sorted: top-p below needs no sort of its own
        logp, ids = logp.topk(min(sampling.top_k, logp.shape[-1]), -1)
        logp = torch.log_softmax(logp, -1)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        sorted_logp, order = (logp, None) if ids is not None else logp.sort(-1, descending=True)
        outside = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() >= sampling.top_p
        sorted_logp = sorted_logp.masked_fill(outside, -math.inf)
        logp = sorted_logp if order is None else logp.scatter(-1, order, sorted_logp)
        logp = torch.log_softmax(logp, -1)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, positions, logp.shape[-1], ids)))
    choice = (logp + gumbel).argmax(-1, keepdim=True)
    tokens = choice[:, 0] if ids is None else ids.gather(-1, choice)[:, 0]
    return tokens, logp.gather(-1, choice)[:, 0]


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def blocks_for(tokens, block_size, copy_on_write=False):
    """KV blocks that hold `tokens` tokens (ceil(tokens / block_size)); copy_on_write adds the one
    a write may copy first, when it starts inside a block it shares with a fork. The one place
    outside PagedCache that turns tokens into blocks: callers ask an Engine (or a PoolShape)."""
    return -(-tokens // block_size) + bool(copy_on_write)


def pool_limit_bytes(token_bytes, block_size=BLOCK_SIZE):
    """The largest KV pool an engine builds (MAX_BLOCKS blocks), in bytes."""
    return MAX_BLOCKS * block_size * token_bytes


def attention_transient_bytes(heads, decode_columns, itemsize):
    """The most memory attention takes beside the pool and the decode memory, in bytes: one padded-path
    SDPA call (ATTENTION_CALL_MB, call_bytes: its mask, folded queries and output, and the
    gathered keys and values the engine keeps for the next call) and the masks a forward keeps
    (at most as much again, Batch), plus a decode step's float32 scores, their softmax and its
    cast (one layer at a time, heads x every decode memory column)."""
    return int(2 * ATTENTION_CALL_MB * 2**20) + decode_columns * heads * (8 + itemsize)


class PoolShape(NamedTuple):
    """What capacity checks read of an engine before any weight loads (eval.pool_shape): its
    tokenizer, device, context and block size, with the Engine's own block arithmetic."""
    tokenizer: object
    device: torch.device
    max_len: int
    block_size: int

    def blocks_for(self, tokens, copy_on_write=False):
        return blocks_for(tokens, self.block_size, copy_on_write)


def capacity_tiers(capacity):
    """The extents a decode bucket of this capacity attends over (CAPACITY_TIERS of them, each a
    multiple of CAPACITY_BUCKET, the last the capacity): a CUDA graph is captured per tier."""
    return sorted({min(capacity, round_up(capacity * i // CAPACITY_TIERS, CAPACITY_BUCKET))
                   for i in range(1, CAPACITY_TIERS + 1)})


def decode_memory_bytes(rows, capacity, token_bytes):
    """The decode memory a bucket of `rows` rows of `capacity` tokens views (DECODE_PAD included)."""
    return rows * (capacity + DECODE_PAD) * token_bytes


def batch_bucket(n):
    """The decode batch shape for n sequences: BATCH_BUCKETS, then multiples of BATCH_STEP."""
    return next((b for b in BATCH_BUCKETS if n <= b), -(-n // BATCH_STEP) * BATCH_STEP)


# -----------------------------------------------------------------------------
# the paged cache and the engine


def zero_pool(shape, dtype, device):
    """A zero tensor for a KV pool. On a CPU it comes from calloc'd memory (numpy.zeros), whose
    pages the OS maps, already zero, only when first written: a pool costs the memory and time
    of what its sequences use, not of its size. (Zeros, not garbage: a masked key's value row
    is multiplied by a weight of 0, and 0 * NaN is NaN.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class PagedCache:
    """A pool of KV blocks shared by many sequences through block tables and reference counts.

    Outside a generate call a sequence's table holds exactly the blocks its length needs. One
    more block, `scratch`, is never handed out: padded decode rows write there."""

    def __init__(self, n_layers, n_kv_heads, head_dim, num_blocks, block_size, dtype, device):
        shape = (n_layers, (num_blocks + 1) * block_size, n_kv_heads, head_dim)
        self.k, self.v = zero_pool(shape, dtype, device), zero_pool(shape, dtype, device)
        self.block_size, self.num_blocks, self.scratch = block_size, num_blocks, num_blocks
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
            self._release(b)
        del self.lengths[sid]

    def _release(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_blocks.append(block)

    def trim(self, sid):
        """Give back the blocks past a sequence's length (reserved for tokens never written)."""
        table, keep = self.tables[sid], blocks_for(self.lengths[sid], self.block_size)
        while len(table) > keep:
            self._release(table.pop())

    def blocks_needed(self, sid, n):
        """Blocks a write of n tokens takes: new ones, plus one if it starts in a shared block."""
        length, table, bs = self.lengths[sid], self.tables[sid], self.block_size
        if n <= 0:
            return 0
        new = max(0, blocks_for(length + n, bs) - len(table))
        return new + bool(length % bs and self.refs[table[length // bs]] > 1)

    def reserve(self, sids, counts):
        """Make room for counts[i] more tokens in each sequence: copy-on-write the shared block
        the write starts in, add fresh blocks. The block copies and the zeroing run as one
        operation each for the whole batch (a probe read forks dozens of sequences at once)."""
        bs, copies, fresh = self.block_size, [], []
        for sid, n in zip(sids, counts):
            table, length = self.tables[sid], self.lengths[sid]
            if n > 0 and length % bs and self.refs[table[length // bs]] > 1:
                old, new = table[length // bs], self.free_blocks.pop()
                self.refs[old] -= 1
                self.refs[new] = 1
                table[length // bs] = new
                copies.append((old, new))
            while len(table) * bs < length + n:
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
            blocks = pool.view(pool.shape[0], self.num_blocks + 1, bs, *pool.shape[2:])
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

    Each sequence may hold pending tokens: known, not yet run through the model (the last sampled
    token, or text the dialogue appended). The next forward that includes it runs them. Callers
    own sequences through new / append / fork / free and never touch the cache's tables."""

    def __init__(self, model, tokenizer=None, block_size=None, num_blocks=None, decode_bytes=None,
                 decode_capacity=None, cache_bytes=None):
        """num_blocks or cache_bytes: the KV pool (default CACHE_GB_CPU, or CACHE_FRACTION_GPU of
        free memory; at most MAX_BLOCKS blocks);
        decode_bytes: the decode memory, the one dense copy every DecodeBatch views (default
        DECODE_COPY_GB, or DECODE_COPY_FRACTION_GPU of free memory); decode_capacity: the most
        tokens a decode memory row holds (default: the model's context). train.py passes its memory
        plan's figures for all three."""
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size or block_size_for(self.device, self.dtype)
        self.use_flash = (flash_usable(self.device, self.dtype)
                          and self.block_size % FLASH_BLOCK_SIZE == 0)
        self.decode_batches = {}  # batch bucket -> DecodeBatch (and its graphs), for the engine's life
        self.addresses = ()  # of the model's parameters, which the graphs captured
        self.refresh()
        w = self.w
        self.token_bytes = 2 * len(w["layers"]) * w["n_kv_heads"] * w["head_dim"] * self.dtype.itemsize
        cuda = self.device.type == "cuda"
        free = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        if num_blocks is None:
            budget = cache_bytes or (free * CACHE_FRACTION_GPU if cuda else CACHE_GB_CPU * 2**30)
            num_blocks = min(int(budget // (self.token_bytes * self.block_size)), MAX_BLOCKS)
        if decode_bytes is None:
            decode_bytes = free * DECODE_COPY_FRACTION_GPU if cuda else DECODE_COPY_GB * 2**30
        self.decode_bytes = int(decode_bytes)
        self.decode_capacity = round_up(decode_capacity or self.max_len + SYNC_EVERY,
                                        CAPACITY_BUCKET)
        self.cache = PagedCache(len(w["layers"]), w["n_kv_heads"], w["head_dim"], num_blocks,
                                self.block_size, self.dtype, self.device)
        self.pending = {}
        self.stop_ids = stop_ids(model, tokenizer) if tokenizer is not None else []
        self.tokens_prefilled = 0
        self.decode_memory = None  # [2, decode_bytes / 2 elements]: keys, values (decode_memory_views)
        self.graph_pool = self.side_stream = None  # CUDA: one graph pool, one capture stream
        self.gather_buffers = [self.cache.k.new_empty(0)] * 2  # Batch.gather's keys and values
        self.graph_capture_s = 0.0  # time spent capturing decode graphs (CUDA)

    def refresh(self, model=None):
        """Read the model's current weights. The fused tensors are the model's own storage
        (fuse), so weights written into the model in place (train.copy_weights, an optimizer
        step) are what the engine reads, at the same addresses: the CUDA graphs stay valid and
        only CPU-packed layouts are rebuilt. `model`, another model of the same shapes, has its
        weights copied into this one's. Storage that moved (a model moved or reloaded) drops the
        graphs, which hold the old addresses."""
        if model is not None and model is not self.model:
            with torch.no_grad():
                mine = dict(self.model.named_parameters())
                for name, p in model.named_parameters():
                    mine[name].copy_(p)
        self.w = layers.fused_weights(self.model)
        addresses = tuple(p.data_ptr() for p in self.model.parameters())
        if addresses != self.addresses:
            self.decode_batches = {}
        self.addresses = addresses
        self.copy_rows = (None, [])  # what the decode memory's rows hold (decode_memory_rows)

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

    @property
    def free_blocks(self):
        return len(self.cache.free_blocks)

    def blocks_for(self, tokens, copy_on_write=False):
        """KV blocks `tokens` tokens take in this engine's pool (engine.blocks_for)."""
        return blocks_for(tokens, self.block_size, copy_on_write)

    def can_fit(self, tokens=0, blocks=0):
        """Whether the free pool takes `tokens` more tokens in fresh blocks plus `blocks` more."""
        return self.blocks_for(tokens) + blocks <= self.free_blocks

    @property
    def max_len(self):
        return self.w["max_len"]

    def overflow(self, sid):
        """Why a sequence cannot take its pending tokens: "context", "cache" (the pool, were the
        sequence alone), or None."""
        n = len(self.pending[sid])
        if self.cache.lengths[sid] + n > self.max_len:
            return "context"
        if self.cache.blocks_needed(sid, n) > len(self.cache.free_blocks):
            return "cache"
        return None

    def admit(self, sids, counts, reserve=0):
        """The sequences, in order, whose next counts[i] tokens the pool takes together, with
        `reserve` blocks left over."""
        room, taken = len(self.cache.free_blocks) - reserve, []
        for sid, n in zip(sids, counts):
            need = self.cache.blocks_needed(sid, n)
            if need <= room:
                room -= need
                taken.append(sid)
        return taken

    @torch.no_grad()
    def forward(self, sids):
        """Run every sequence's pending tokens; return each sequence's last-token logits [B, V].

        The blocks of the whole batch, copy-on-write included, are checked before anything is
        written: a batch the pool cannot take raises and leaves every sequence as it was."""
        w, cache = self.w, self.cache
        news = [self.pending[s] for s in sids]
        assert all(news), "every sequence in a forward needs at least one pending token"
        counts = [len(t) for t in news]
        if any(self.overflow(s) == "context" for s in sids):
            raise RuntimeError("engine.py: a sequence in this forward would pass the model's "
                               f"context of {self.max_len} tokens; check Engine.overflow first")
        if len(self.admit(sids, counts)) < len(sids):
            need = sum(cache.blocks_needed(s, n) for s, n in zip(sids, counts))
            raise RuntimeError(f"engine.py: this forward of {len(sids)} sequences needs {need} KV "
                               f"blocks, the pool has {len(cache.free_blocks)} free; run the "
                               "sequences Engine.admit returns, or fewer at once")
        starts = [cache.lengths[s] for s in sids]
        cache.reserve(sids, counts)
        q_lens = torch.tensor(counts)
        kv_lens = torch.tensor(starts) + q_lens
        ids = torch.tensor([t for toks in news for t in toks], device=self.device)
        positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, news)])
        slots = torch.cat([cache.slots(s, st, len(t)) for s, st, t in zip(sids, starts, news)])
        batch = Batch(self, sids, q_lens, kv_lens, positions, slots)
        x = layers.decoder(w, ids, positions.to(self.device), batch.attention)
        last = torch.cumsum(q_lens, 0).to(self.device) - 1
        logits = layers.lm_logits(w, x[last])
        for s, n in zip(sids, counts):
            cache.lengths[s] += n
            self.pending[s] = []
        self.tokens_prefilled += len(ids)
        return logits.float()

    def generate(self, sids, max_new_tokens=MAX_NEW_TOKENS, sampling=GREEDY, keys=None,
                 stop_ids=None):
        """Sample a message for each sequence after its pending tokens.

        keys[i] is sequence i's random stream (stream_key); token j of a sequence is drawn from
        noise keyed by (key, position), so what a sequence samples does not depend on the rows
        beside it. The first step runs every pending token in one ragged forward; the rest run on
        a fixed-shape DecodeBatch, SYNC_EVERY steps between host checks.

        Returns, per sequence, (token ids, log-probs, finish reason): "stop" (the stop token is
        the last id), "length", "context" (the model's context is full) or "cache" (the pool
        could not take its next tokens; it ends cleanly with what it has). The last sampled
        token stays pending in the sequence."""
        stop = set(self.stop_ids if stop_ids is None else stop_ids)
        keys = dict(zip(sids, keys if keys is not None else [0] * len(sids)))
        out = {s: ([], [], None) for s in sids}
        self._eager_step(list(sids), [len(self.pending[s]) for s in sids], max_new_tokens,
                         sampling, keys, out, stop)
        active = [s for s in sids if out[s][2] is None]
        while active:  # another DecodeBatch whenever the sequences left fit a smaller bucket
            reach = self._reach(active, max_new_tokens)
            rows = len(active)  # as many rows a DecodeBatch as decode memory holds at this reach
            while rows and self.decode_capacity_for(batch_bucket(rows)) < reach:
                rows -= 1
            if not rows:  # one row would not fit the decode memory: the ragged forward, step by step
                self._decode_eager(active, max_new_tokens, sampling, keys, out, stop)
            for i in range(0, len(active), rows) if rows else ():
                self._decode(active[i:i + rows], max_new_tokens, sampling, keys, out, stop)
            active = [s for s in active if out[s][2] is None]
        for s in sids:
            self.cache.trim(s)
        return [out[s] for s in sids]

    def decode_capacity_for(self, rows):
        """Tokens each row of a `rows`-row DecodeBatch holds in the decode memory: what
        decode_bytes gives a row (one scratch column kept), rounded down to CAPACITY_BUCKET, at most
        decode_capacity. Fixed per bucket, so a bucket's CUDA graph is captured once."""
        columns = self.decode_bytes // (self.token_bytes * rows) - DECODE_PAD
        return min(columns // CAPACITY_BUCKET * CAPACITY_BUCKET, self.decode_capacity)

    def decode_memory_views(self, n):
        """Keys and values of a DecodeBatch, n elements each: views of the engine's one
        decode memory of decode_bytes, allocated at first use and never again (every bucket views it).
        On a CPU it is left untouched until used (fresh memory costs its first touch: zero-filling
        an 8-row copy took 0.25 s of page faults); on CUDA it starts zeroed, since a graph step
        reads every column up to the capacity and masks the unwritten ones, which must be finite."""
        if self.decode_memory is None:
            per_side = self.decode_bytes // (2 * self.dtype.itemsize)
            make = self.cache.k.new_zeros if self.device.type == "cuda" else self.cache.k.new_empty
            self.decode_memory = make(2, per_side)
        return self.decode_memory[0, :n], self.decode_memory[1, :n]

    def decode_memory_rows(self, rows):
        """What each decode memory row holds for a `rows`-row DecodeBatch (DecodeBatch.filled):
        kept while batches of this bucket use it, reset once another bucket's view wrote it."""
        if self.copy_rows[0] != rows:
            self.copy_rows = (rows, [None] * rows)
        return self.copy_rows[1]

    def gather_memory(self, side, n):
        """n elements for one layer's gathered keys (side 0) or values (side 1) in an eager
        forward, reused by every layer and forward: a fresh copy each layer paid its page faults
        every time (an 18 MB probe-read gather took 1.9 ms fresh, 0.6 ms into kept memory)."""
        if self.gather_buffers[side].numel() < n:
            self.gather_buffers[side] = None
            self.gather_buffers[side] = self.cache.k.new_empty(n)
        return self.gather_buffers[side][:n]

    def _tensor(self, values):
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _reach(self, sids, max_new_tokens):
        """Past the last position any decode step of these sequences can write or read."""
        return min(max(map(self.cached, sids)) + max_new_tokens, self.max_len) + SYNC_EVERY

    def _admit_step(self, sids, counts, out):
        """The sequences whose next counts[i] tokens fit, in order; the others end, "context"
        where the model's context is full, else "cache" (nothing frees blocks inside a call)."""
        fits = [s for s, n in zip(sids, counts) if self.cached(s) + n <= self.max_len]
        for s in set(sids) - set(fits):
            out[s] = (*out[s][:2], "context")
        taken = self.admit(fits, [n for s, n in zip(sids, counts) if s in fits])
        for s in set(fits) - set(taken):
            out[s] = (*out[s][:2], "cache")
        return taken

    def _take(self, sid, tokens, logps, out, stop, max_new_tokens):
        """Record the tokens a sequence sampled until a stop token or its limit; the last one
        taken stays pending. Returns how many were taken."""
        ids, lps, _ = out[sid]
        for n, (t, lp) in enumerate(zip(tokens, logps), 1):
            ids.append(t)
            lps.append(lp)
            reason = ("stop" if t in stop else "length" if len(ids) >= max_new_tokens else None)
            if reason:
                out[sid] = (ids, lps, reason)
                break
        self.pending[sid] = ids[-1:]
        return n

    def _decode(self, sids, max_new_tokens, sampling, keys, out, stop):
        """Decode windows of SYNC_EVERY fixed-shape steps until every sequence has ended, or
        until those left fit a smaller batch bucket (finished rows still cost compute)."""
        bucket = batch_bucket(len(sids))
        if bucket not in self.decode_batches:  # one a bucket, for the engine's life
            self.decode_batches[bucket] = DecodeBatch(self, bucket, self.decode_capacity_for(bucket))
        batch = self.decode_batches[bucket]
        batch.begin(sids, min(batch.capacity, self._reach(sids, max_new_tokens)))
        active = list(sids)
        while active:
            room = [min(SYNC_EVERY, max_new_tokens - len(out[s][0]), self.max_len - self.cached(s))
                    for s in active]
            for s, n in zip(active, room):
                if n <= 0:  # the model's context is full
                    out[s] = (*out[s][:2], "context")
            room = {s: n for s, n in zip(active, room) if n > 0}
            active = list(room)
            running = self._admit_step(active, [room[s] for s in active], out)
            if not running:
                return
            steps = max(room[s] for s in running)
            self.cache.reserve(running, [room[s] for s in running])
            tokens, logps = batch.run(running, [keys[s] for s in running], steps, sampling)
            for s in running:
                row, n = batch.sids.index(s), room[s]
                taken = self._take(s, tokens[row][:n], logps[row][:n], out, stop, max_new_tokens)
                self.cache.lengths[s] += taken  # each step wrote its input token
                self.tokens_prefilled += taken
                batch.filled[row] = (s, self.cache.lengths[s])
            active = [s for s in active if out[s][2] is None]
            if active and batch_bucket(len(active)) < bucket:
                return

    def _eager_step(self, sids, counts, max_new_tokens, sampling, keys, out, stop):
        """One ragged forward of the sequences whose next counts[i] tokens fit, and a sample
        each; returns those still going."""
        running = self._admit_step(sids, counts, out)
        if not running:
            return []
        logits = self.forward(running)
        tokens, logps = sample(logits, sampling, self._tensor([keys[s] for s in running]),
                               self._tensor([self.cached(s) for s in running]))
        for s, t, lp in zip(running, tokens.tolist(), logps.tolist()):
            self._take(s, [t], [lp], out, stop, max_new_tokens)
        return [s for s in running if out[s][2] is None]

    def _decode_eager(self, sids, max_new_tokens, sampling, keys, out, stop):
        """Decode through the ragged forward, one step at a time (a row too big to copy)."""
        active = list(sids)
        while active:
            active = self._eager_step(active, [1] * len(active), max_new_tokens, sampling, keys,
                                      out, stop)


class DecodeBatch:
    """Fixed-shape decode steps for one batch bucket: every tensor a step reads lives here or in
    the engine's decode memory on the device and keeps its shape and address, so that on CUDA a
    step is captured once as a graph (per sampling) and replayed for the engine's life, weight
    refreshes included; on a CPU the same step runs eagerly.

        rows      B = the bucket; rows past the sequences and rows not running are padded and
                  inert: they write into the pool's scratch block and the copy's scratch column,
                  their position does not move, their samples are discarded
        capacity  Engine.decode_capacity_for(B) tokens a row, fixed for the bucket; a graph step
                  attends over all of them (the unwritten ones masked), an eager step over the
                  columns its positions reach
        keys_t    each row's keys, dense and transposed [layers, B, kv_heads, head_dim, capacity +
                  DECODE_PAD] (layers.decode_attention; every key row 32-byte aligned, column capacity
                  the scratch one), and values [layers, B, kv_heads, capacity + DECODE_PAD, head_dim]:
        values    views of the engine's one decode memory (Engine.decode_memory_views), copied
                  from the pool and kept between calls (filled); each step writes its token into
                  both, so the pool stays the cache of record
        filled    per row, (sequence, tokens of it the row holds): a row that holds its sequence's
                  first tokens from the last call takes only the tokens cached since; reset when
                  another bucket's view wrote the decode memory (Engine.decode_memory_rows)
        metadata  tokens, positions, the running mask, stream keys and block tables, written from
                  the host once a window of SYNC_EVERY steps; the mask of visible keys is built on
                  the device from the positions"""

    def __init__(self, engine, rows, capacity):
        cache, dev = engine.cache, engine.device
        # a weak reference: the engine keeps its batches, and a cycle would keep its pool alive
        # until the garbage collector (or interpreter shutdown) came to it
        self.engine = weakref.proxy(engine)
        self.capacity, self.block_size = capacity, cache.block_size
        layers, _, kv_heads, head_dim = cache.k.shape
        keys_shape = (layers, rows, kv_heads, head_dim, capacity + DECODE_PAD)
        values_shape = (layers, rows, kv_heads, capacity + DECODE_PAD, head_dim)
        keys, values = engine.decode_memory_views(math.prod(values_shape))
        self.keys_t, self.values = keys.view(keys_shape), values.view(values_shape)
        self.filled = engine.decode_memory_rows(rows)
        new = lambda fill=0, dtype=torch.long: torch.full((rows,), fill, dtype=dtype, device=dev)
        self.tokens, self.positions, self.keys = new(), new(), new()
        self.live = new(False, torch.bool)
        self.tables = torch.full((rows, capacity // cache.block_size + 1), cache.scratch,
                                 dtype=torch.long, device=dev)
        self.rows, self.kv_pos = torch.arange(rows, device=dev), torch.arange(capacity, device=dev)
        self.tiers = capacity_tiers(capacity)
        self.graphs = {}  # (sampling, tier) -> (graph, outputs)

    def begin(self, sids, limit):
        """Bring the dense copy up to date with these sequences' cached keys and values: a row
        that already holds the first tokens of its sequence (the same sequence last call) takes
        only the tokens cached since. Columns from a row's length up to `limit` (beyond any key
        the coming steps reach, rounded up to its capacity tier, which a step may read) are
        zeroed: memory never written may hold anything, and a masked key's weight is 0 only
        when its value is finite."""
        limit = self.tier(limit)
        cache, self.sids = self.engine.cache, list(sids)
        self.filled = self.engine.decode_memory_rows(len(self.tokens))
        for row, sid in enumerate(self.sids):
            n = cache.lengths[sid]
            start = self.filled[row][1] if self.filled[row] and self.filled[row][0] == sid else 0
            slots = cache.slots(sid, start, n - start).to(self.values.device)
            for layer in range(len(cache.k)):  # a layer at a time: what is read stays in cache
                self.keys_t[layer, row, :, :, start:n] = cache.k[layer, slots].permute(1, 2, 0)
                self.values[layer, row, :, start:n] = cache.v[layer, slots].transpose(0, 1)
            self.keys_t[:, row, :, :, n:limit] = 0
            self.values[:, row, :, n:limit] = 0
            self.filled[row] = (sid, n)
        for row in range(len(self.sids), len(self.filled)):
            self.filled[row] = None

    def load(self, running, keys):
        """Host -> device, once a window: which rows run, their pending token, position, key
        and block table."""
        eng, rows = self.engine, len(self.tokens)
        live, tokens, positions, key = ([0] * rows for _ in range(4))
        tables = torch.full(self.tables.shape, eng.cache.scratch, dtype=torch.long)
        for row, sid in enumerate(self.sids):
            positions[row] = eng.cached(sid)
            table = eng.cache.tables[sid][:tables.shape[1]]
            tables[row, :len(table)] = torch.tensor(table, dtype=torch.long)
        for sid, k in zip(running, keys):
            row = self.sids.index(sid)
            live[row], tokens[row], key[row] = 1, eng.pending[sid][0], k
        for dst, src in ((self.live, live), (self.tokens, tokens), (self.positions, positions),
                         (self.keys, key)):
            dst.copy_(torch.tensor(src, dtype=dst.dtype))
        self.tables.copy_(tables)
        return max(positions[self.sids.index(s)] for s in running)

    def step(self, extent, sampling):
        """One decode step of every row, keys visible up to `extent` (a capacity tier in a graph)."""
        w, cache, bs = self.engine.w, self.engine.cache, self.block_size
        pos = self.positions
        block = self.tables.gather(1, (pos // bs).clamp(max=self.tables.shape[1] - 1)[:, None])[:, 0]
        slots = torch.where(self.live, block * bs + pos % bs, cache.scratch * bs)
        column = torch.where(self.live, pos.clamp(max=self.capacity - 1), self.capacity)
        hidden = self.kv_pos[:extent] > column[:, None, None]
        bias = torch.zeros(hidden.shape, device=pos.device)  # float32: the scores' dtype
        bias = bias.masked_fill_(hidden, -math.inf).repeat_interleave(w["n_kv_heads"], 0)

        def attend(layer, q, k, v):
            cache.k[layer][slots] = k
            cache.v[layer][slots] = v
            self.keys_t[layer][self.rows, :, :, column] = k
            self.values[layer][self.rows, :, column] = v
            return layers.decode_attention(q, self.keys_t[layer][..., :extent],
                                    self.values[layer][:, :, :extent], bias)

        logits = layers.lm_logits(w, layers.decoder(w, self.tokens, pos, attend))
        tokens, logps = sample(logits, sampling, self.keys, pos + 1)
        self.tokens.copy_(torch.where(self.live, tokens, self.tokens))
        self.positions.add_(self.live.long())
        return tokens, logps

    @torch.no_grad()
    def run(self, running, keys, steps, sampling):
        """`steps` decode steps of the running sequences; tokens and log-probs per row as lists,
        read back once."""
        start = self.load(running, keys)
        graph = self.engine.device.type == "cuda" and CUDA_GRAPHS
        tokens = torch.empty(len(self.tokens), steps, dtype=torch.long, device=self.tokens.device)
        logps = torch.empty(tokens.shape, dtype=torch.float32, device=self.tokens.device)
        tier = self.tier(start + steps)  # the columns the window's last step reaches
        for j in range(steps):
            live = min(start + j + 1, self.capacity)
            t, lp = (self.replay(sampling, tier) if graph else
                     self.step(tier if DECODE_EXTENT == "tier" else live, sampling))
            tokens[:, j], logps[:, j] = t, lp
        return tokens.tolist(), logps.tolist()

    def tier(self, reach):
        """The smallest of the bucket's capacity tiers (capacity_tiers) that holds `reach` columns."""
        return next((t for t in self.tiers if t >= reach), self.capacity)

    def replay(self, sampling, extent):
        """The step as a CUDA graph over `extent` columns (a capacity tier), captured on first use
        for this sampling and tier (while every row is inert, so that capturing writes nothing
        but scratch) and kept for the engine's life: its tensors, the decode memory and the weights
        never move."""
        if (sampling, extent) not in self.graphs:
            start = time.perf_counter()
            live = self.live.clone()
            self.live.zero_()
            if self.engine.graph_pool is None:  # one pool and one capture stream an engine
                self.engine.graph_pool = torch.cuda.graph_pool_handle()
                self.engine.side_stream = torch.cuda.Stream()
            side = self.engine.side_stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(extent, sampling)  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.engine.graph_pool):
                outputs = self.step(extent, sampling)
            self.graphs[sampling, extent] = (graph, outputs)
            self.live.copy_(live)
            self.engine.graph_capture_s += time.perf_counter() - start
        graph, outputs = self.graphs[sampling, extent]
        graph.replay()
        return outputs


class Call(NamedTuple):
    """One SDPA call of the padded path: sequences first..first + rows - 1 of a Batch, packed
    query tokens lo..hi - 1 of it, padded to `width` query rows a sequence (left-padded: row r
    of sequence b sits at position q_pos[b, r]); keys of each sequence up to kv_lens[b] (the
    table columns its queries can see)."""
    lo: int
    hi: int
    index: torch.Tensor    # packed token lo + i -> row of the padded [rows * width] queries
    q_pos: torch.Tensor    # [rows, width] position of each padded query row (clamped at 0)
    kv_lens: torch.Tensor  # [rows] keys visible to the call's last query of each sequence
    tables: torch.Tensor   # [rows, blocks] block table columns read


def call_bytes(rows, width, keys, heads, kv_heads, head_dim, itemsize):
    """What one padded attention call holds beside the pool, in bytes: the additive mask
    [rows, 1, width * G, keys] (G = heads / kv_heads query heads a kv head, folded into the
    query rows), the gathered keys and values, and the folded queries and their output. SDPA's
    memory-efficient kernel itself keeps one float32 log-sum-exp a query row (counted too)."""
    group = heads // kv_heads
    return rows * (itemsize * (width * group * keys + 2 * keys * kv_heads * head_dim
                               + 2 * width * heads * head_dim) + 4 * width * heads)


def padded_calls(q_lens, kv_lens, tables, block_size, cost, budget):
    """The padded path's SDPA calls: runs of whole sequences whose call stays within `budget`
    bytes (cost(rows, width, keys)), and a sequence too large alone in windows of its queries
    (each window reads only the keys its last query sees). Every transient is so bounded."""
    q, kv = q_lens.tolist(), kv_lens.tolist()
    starts = [0] + list(itertools.accumulate(q))
    spans, b = [], 0  # (first, end, window start, window end) with windows counted per sequence
    while b < len(q):
        e = b + 1
        while e < len(q) and cost(e + 1 - b, max(q[b:e + 1]),
                                  blocks_for(max(kv[b:e + 1]), block_size) * block_size) <= budget:
            e += 1
        if e - b > 1 or cost(1, q[b], blocks_for(kv[b], block_size) * block_size) <= budget:
            spans.append((b, e, 0, max(q[b:e])))
        else:  # the keys fixed, the queries in windows that fit (one row at the least)
            keys = blocks_for(kv[b], block_size) * block_size
            per_row = cost(1, 2, keys) - cost(1, 1, keys)
            width = max(1, (budget - cost(1, 0, keys)) // per_row)
            spans += [(b, b + 1, w, min(w + width, q[b])) for w in range(0, q[b], width)]
        b = e
    calls = []
    for first, end, w0, w1 in spans:
        width, whole = w1 - w0, max(q[first:end])  # whole: the sequences' padded query rows
        lens = torch.tensor(kv[first:end]) - (whole - w1)  # keys the window's last row sees
        rows = torch.arange(end - first)
        pos = torch.tensor(kv[first:end])[:, None] - whole + torch.arange(w0, w1)
        lo = starts[first] + (w0 if end - first == 1 else 0)
        hi = starts[end] - (q[first] - w1 if end - first == 1 else 0)
        pad = torch.repeat_interleave(rows, torch.tensor(q[first:end]))  # packed -> sequence
        if end - first == 1:
            index = torch.arange(hi - lo)
        else:  # token t of sequence i sits in padded row whole - q_i + t
            offset = torch.tensor(starts[first:end]) - (whole - torch.tensor(q[first:end]))
            index = pad * width + torch.arange(lo, hi) - offset[pad]
        n_blocks = blocks_for(int(lens.max()), block_size)
        calls.append(Call(lo, hi, index, pos.clamp(min=0), lens, tables[first:end, :n_blocks]))
    return calls


def call_mask(call, keys, group, dtype):
    """The additive mask [rows, 1, width * group, keys] of a Call: 0 where padded query row r of
    a sequence sees key j (j <= its position and j < the sequence's visible keys), else -inf,
    each row repeated for the `group` query heads that the call folds into its query rows
    (padding rows see key 0, so no row is all -inf)."""
    kv_pos = torch.arange(keys, device=call.q_pos.device)
    visible = (kv_pos <= call.q_pos[:, :, None]) & (kv_pos < call.kv_lens[:, None, None])
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, -math.inf).repeat_interleave(group, 1)[:, None]


class Batch:
    """Per-forward attention metadata: where each sequence's new keys go and its keys come from.

    This is the ragged, eager forward (prefill, probe forks, and decode where no DecodeBatch
    fits); generate's decode steps run on DecodeBatch. Attention takes one of four paths:
      flash   flash-attn reads the pool through the block tables (queries padded on the left)
      padded  PyTorch elsewhere on a GPU: blocks gathered, one SDPA call, queries padded on the
              left and a mask (few kernel launches, which is what counts there)
    and on COMPUTE_BOUND_DEVICES (a CPU), where padding costs compute and calls are cheap:
      split   prefill: one SDPA call a sequence over its gathered keys, no padding
      decode  one query a sequence: two batched products over its gathered blocks"""

    def __init__(self, engine, sids, q_lens, kv_lens, positions, slots):
        cache, dev = engine.cache, engine.device
        self.engine, self.slots = engine, slots.to(dev)
        self.kv_lens = kv_lens
        B, bs = len(sids), cache.block_size
        self.q_max, self.kv_max = int(q_lens.max()), int(kv_lens.max())
        if engine.use_flash:
            self.path = "flash"
        elif dev.type not in COMPUTE_BOUND_DEVICES:
            self.path = "padded"
        else:
            self.path = "decode" if self.q_max == 1 else "split"
        n_blocks = max(len(cache.tables[s]) for s in sids)
        tables = torch.zeros(B, n_blocks, dtype=torch.long)
        for b, s in enumerate(sids):
            tables[b, :len(cache.tables[s])] = torch.tensor(cache.tables[s])
        self.tables = tables.to(dev)
        if self.path == "decode":  # additive mask [B * kv_heads, 1, K]: 0 or -inf
            kv_pos = torch.arange(n_blocks * bs)
            bias = torch.zeros(B, 1, len(kv_pos)).masked_fill_(kv_pos >= kv_lens[:, None, None],
                                                               -math.inf)
            self.bias = bias.repeat_interleave(engine.w["n_kv_heads"], 0).to(dev)  # float32
        if self.path == "flash":  # queries padded on the left to [B, Q]: padded row
            # i of sequence b is its position kv_len - Q + i (bottom-right causal alignment)
            row = torch.repeat_interleave(torch.arange(B), q_lens)
            col = positions - (kv_lens - self.q_max)[row]
            self.pad_index = (row * self.q_max + col).to(dev)  # packed token -> [B * Q] row
        if self.path == "padded":  # SDPA calls of bounded size, grouped query heads folded
            w = engine.w  # into the query rows (Call, call_mask)
            self.group = w["n_heads"] // w["n_kv_heads"]
            cost = functools.partial(call_bytes, heads=w["n_heads"], kv_heads=w["n_kv_heads"],
                                     head_dim=w["head_dim"], itemsize=engine.dtype.itemsize)
            self.calls = [c._replace(index=c.index.to(dev), q_pos=c.q_pos.to(dev),
                                     kv_lens=c.kv_lens.to(dev)) for c in
                          padded_calls(q_lens, kv_lens, self.tables, bs, cost,
                                       int(ATTENTION_CALL_MB * 2**20))]
            masks = [c.q_pos.numel() * self.group * c.tables.shape[1] * bs for c in self.calls]
            # additive, built once a forward when all of them fit one call's budget, else once
            # a call a layer: SDPA would otherwise turn a boolean mask into one every call
            self.masks = ([call_mask(c, c.tables.shape[1] * bs, self.group, engine.dtype)
                           for c in self.calls]
                          if sum(masks) * engine.dtype.itemsize <= ATTENTION_CALL_MB * 2**20
                          else None)
        if self.path == "split":  # sequence b's queries: packed rows lo..hi, its last keys
            ends = torch.cumsum(q_lens, 0).tolist()
            self.spans = [(end - n, end, kv) for end, n, kv in
                          zip(ends, q_lens.tolist(), kv_lens.tolist())]
            self.masks = [None if hi - lo == kv else  # a fresh prefill: SDPA's own causal mask
                          (torch.arange(kv) <= torch.arange(kv - hi + lo, kv)[:, None]).to(dev)
                          for lo, hi, kv in self.spans]

    def gather(self, pool, side, tables=None):
        """Each sequence's keys (side 0) or values (side 1) as [B, blocks * block_size, kv_heads,
        head_dim] through its block table (default: the Batch's): whole blocks are copied, which
        is a plain memory copy per block, and the mask hides the tail. The copy lands in memory
        the engine keeps (Engine.gather_memory)."""
        tables = self.tables if tables is None else tables
        B, n_blocks = tables.shape
        blocks = pool.view(-1, self.engine.cache.block_size, *pool.shape[1:])
        out = self.engine.gather_memory(side, B * n_blocks * blocks[0].numel())
        out = out.view(-1, *blocks.shape[1:])
        return torch.index_select(blocks, 0, tables.flatten(), out=out).view(B, -1,
                                                                            *pool.shape[1:])

    def padded_call(self, layer, i, q):
        """Call i of the padded path on its packed queries q [n, H, D]: each kv head's G query
        heads folded into the query rows ([rows, kv_heads, width * G, D]), so that SDPA sees
        equal head counts and an additive mask, which its memory-efficient kernel takes on a GPU
        (a masked grouped-query call would run only on MATH, with float32 scores of every head)."""
        call, cache, G = self.calls[i], self.engine.cache, self.group
        rows, width = call.q_pos.shape
        H, D = q.shape[1:]
        keys = self.gather(cache.k[layer], 0, call.tables)
        values = self.gather(cache.v[layer], 1, call.tables)
        padded = q.new_zeros(rows * width, H, D).index_copy_(0, call.index, q)
        folded = padded.view(rows, width, H // G, G, D).transpose(1, 2).reshape(
            rows, H // G, width * G, D)
        mask = (self.masks[i] if self.masks is not None else
                call_mask(call, keys.shape[1], G, q.dtype))
        out = F.scaled_dot_product_attention(folded, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask)
        return out.view(rows, H // G, width, G, D).transpose(1, 2).reshape(rows * width, H, D)[
            call.index]

    def attention(self, layer, q, k, v):
        """Write this step's k, v into the pool, then attend over each sequence's whole cache."""
        cache = self.engine.cache
        cache.k[layer][self.slots] = k
        cache.v[layer][self.slots] = v
        if self.path == "flash":
            bs = cache.block_size
            out = flash_attn_with_kvcache(
                self.pad(q), cache.k[layer].view(-1, bs, *cache.k.shape[2:]),
                cache.v[layer].view(-1, bs, *cache.v.shape[2:]),
                cache_seqlens=self.kv_lens.to(q.device, torch.int32),
                block_table=self.tables.to(torch.int32), causal=True)
            return out.flatten(0, 1)[self.pad_index]
        if self.path == "padded":
            if len(self.calls) == 1:
                return self.padded_call(layer, 0, q)
            out = q.new_empty(q.shape)
            for i, call in enumerate(self.calls):
                out[call.lo:call.hi] = self.padded_call(layer, i, q[call.lo:call.hi])
            return out
        keys, values = self.gather(cache.k[layer], 0), self.gather(cache.v[layer], 1)
        if self.path == "decode":
            return layers.decode_attention(q, keys.permute(0, 2, 3, 1), values.transpose(1, 2), self.bias)
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


def generate(model, prompts, max_new_tokens, sampling=GREEDY, stop_ids=None, seed=0,
             block_size=None):
    """Token ids in, token ids out, through the paged engine (stop token kept, like HF); prompt
    i samples from the stream stream_key(seed, i)."""
    engine = Engine(model, block_size=block_size)
    sids = [engine.new(p) for p in prompts]
    outs = engine.generate(sids, max_new_tokens, sampling,
                           [stream_key(seed, i) for i in range(len(sids))], stop_ids or [])
    for s in sids:
        engine.free(s)
    return [ids for ids, _, _ in outs]


def shared_stem(seqs):
    """Length of the longest common prefix of token lists that still leaves each its last token
    (os.path.commonprefix compares any sequences element by element)."""
    return min(len(os.path.commonprefix(seqs)), min(map(len, seqs)) - 1)
