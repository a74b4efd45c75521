"""
engine.py: batched generation on a paged KV cache, in plain PyTorch. It knows no dialogue.

A context is a sequence: a block table into a shared pool plus a length. Callers create sequences,
append tokens, fork and free them through the Engine's methods; the next forward runs every
appended ("pending") token, so every token is prefilled exactly once. One path, from block
tables to a sampled token:

    cache   a pool of KV blocks [2 (keys, values), layers, blocks * BLOCK_SIZE, kv_heads, head_dim];
            a sequence is a block table (list of block ids) plus a length; blocks carry reference
            counts.
            Token t of a sequence sits at slot table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE.
    fork    a child shares every block of its parent (refcount + 1); the shared partial last block
            is copied the first time either side writes into it (copy-on-write).
    forward x_{l+1} = x_l + Attn(RMSNorm(x_l)) ; x_{l+2} = x_{l+1} + MLP(RMSNorm(x_{l+1}))
            (layers.py) over a packed batch of new tokens (ragged lengths); attention writes the
            new keys and values into their slots, then reads each sequence's keys and values
            through its block table (paged_attention):
            softmax(q k^T / sqrt(d) + causal mask) v.
    sample  token = argmax(log p + g), g = -log(-log u) (Gumbel-max: a draw from p), with
            p = softmax(logits / T), optionally top-k / top-p truncated, and u a counter-based
            hash of (stream key, position, token id): what a sequence samples does not depend on
            the rows beside it. Its log p is recorded: log pi_old for training.
    decode  one forward of every sequence's last token, one sample each, until a stop token,
            the length limit, the model's context or the pool ends it (Engine.decode_loop).
    capacity a forward reserves the blocks of its whole batch, copy-on-write included, before
            writing anything; admit() says which sequences fit.

That is the reference. FAST_PATH (or Engine(fast_path=...)) hands the forward's attention and the
decode steps to lab/fastpath.py, which computes the same tokens faster (flash-attn's paged
kernels, padded SDPA calls, fixed-shape decode batches over a dense copy of the cache, CUDA graphs,
oneDNN-packed CPU weights); it is on by default, since it is faster on a CPU and on a GPU.
The forward is written against the Hugging Face weights of Llama, Qwen2 and Qwen3 and tested token
for token against Hugging Face `generate` on both paths.

    python -m pytest -q tests/test_engine.py    # engine tests on tiny random models, both paths
    python -m lab.bench                         # the rollout workload against two baselines
"""
import contextlib
import math
import os
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from persuarena import layers
from lab import fastpath

FAST_PATH = True          # the forward's attention and the decode steps on lab/fastpath.py
BLOCK_SIZE = 16           # tokens per KV block (lab.fastpath.FLASH_BLOCK_SIZE with flash-attn)
CACHE_GB_CPU = 2.0        # KV pool size on a CPU
CACHE_FRACTION_GPU = 0.15  # share of free GPU memory given to each engine's KV pool
MAX_BLOCKS = 1 << 16      # pool size cap (small models would otherwise get millions of blocks)
COMPUTE_BOUND_DEVICES = ("cpu",)  # where compute, not kernel launches, is the cost: prefill
# attention a sequence at a time, the probes' common opening prefilled once
MAX_NEW_TOKENS = 256      # per message (--max-new-tokens; the cpu and tiny presets set 32, 4)
ENGINE_THREADS = "free"   # torch threads of a CPU forward or decode window: "free", the cores
# other processes leave free at its start (cpu_threads, up or down); "all", the process's
FORWARD_TOKENS = 8192     # new tokens a forward runs at once: a larger batch (the judge's prompts, the
# fidelity check's forks) runs in consecutive chunks, so its MLP transient stays bounded (lab/plan.py)


def stop_ids(model, tokenizer):
    """End-of-message token ids: the tokenizer's eos, the generation config's, and <|im_end|>."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def token_chunks(counts, limit):
    """[start, stop) ranges of consecutive sequences whose token counts sum to at most limit
    (a longer sequence alone): the forwards a batch of new tokens runs in."""
    chunks, start, total = [], 0, 0
    for i, n in enumerate(counts):
        if i > start and total + n > limit:
            chunks.append((start, i))
            start, total = i, 0
        total += n
    return chunks + [(start, len(counts))] if counts else chunks


def running_elsewhere():
    """Tasks running or runnable on the machine at this instant that are not this process's
    threads: /proc/loadavg's count of runnable tasks less this process's own running threads
    (/proc/self/task/*/stat), 0 where those files do not exist."""
    try:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        own = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:  # a thread that just ended
                continue
            own += stat[stat.rindex(")") + 2] == "R"
        return max(0, runnable - own)
    except (OSError, ValueError, IndexError):
        return 0


def process_cores():
    """The most threads this process runs on a CPU: OMP_NUM_THREADS when set, else its cores."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def free_cores(samples=3):
    """The cores other processes leave free now, at least one and at most process_cores: its
    cores less the fewest tasks running elsewhere over a few instant samples (a task that keeps
    a core busy is in every sample, a passing one in few). A process held to one thread
    (OMP_NUM_THREADS=1) has nothing to read: one."""
    most = process_cores()
    if most == 1:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(most, cores - min(running_elsewhere() for _ in range(samples))))


@contextlib.contextmanager
def cpu_threads(device, policy=None):
    """Torch threads for one engine forward or decode window on a CPU: with ENGINE_THREADS (or
    `policy`) "free", as many as the cores other processes leave free at its start
    (free_cores): fewer or more than the process's threads, which are restored afterwards. Its
    operations are small parallel regions whose threads wait on one another: on a busy machine
    a thread without a core stalls every region (two threads beside two busy processes made a
    SmolLM2 decode step 4-9x slower than one thread did, its prefill several times slower), and
    the load average that sets the process's threads (models.set_cpu_threads) lags a minute."""
    if torch.device(device).type != "cpu" or (policy or ENGINE_THREADS) == "all":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(free_cores())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def block_size_for(device, dtype, fast_path=None):
    """Tokens per KV block of an engine on `device` in `dtype` (before any weight loads): the fast
    path's flash-attn block size where its kernels run, else BLOCK_SIZE."""
    fast = FAST_PATH if fast_path is None else fast_path
    return (fast and fastpath.flash_block_size(device, dtype)) or BLOCK_SIZE


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


def blocks_for(tokens, block_size, copy_on_write=False):
    """KV blocks that hold `tokens` tokens (ceil(tokens / block_size)); copy_on_write adds the one
    a write may copy first, when it starts inside a block it shares with a fork. The one place
    outside PagedCache that turns tokens into blocks: callers ask an Engine (or a PoolShape)."""
    return -(-tokens // block_size) + bool(copy_on_write)


def pool_limit_bytes(token_bytes, block_size=None):
    """The largest KV pool an engine builds (MAX_BLOCKS blocks of block_size, default
    BLOCK_SIZE, tokens), in bytes."""
    return MAX_BLOCKS * (block_size or BLOCK_SIZE) * token_bytes


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


def paged_attention(cache, sids, slots, q_lens, kv_lens):
    """attend(layer, q, kv) for a forward of these sequences, reading the pool through the
    block tables: this step's keys and values kv [N, 2, kv_heads, D] go to their slots, then each sequence's
    queries attend over its keys and values gathered slot by slot,
        softmax(q k^T / sqrt(d) + mask) v,  mask: query at position p sees keys 0..p,
    one SDPA call a sequence (grouped-query heads: kv head h serves query heads h*G..h*G+G-1)."""
    ends = torch.cumsum(q_lens, 0).tolist()
    spans = [(end - n, end) for end, n in zip(ends, q_lens.tolist())]
    key_slots = [cache.slots(s, 0, kv).to(cache.k.device) for s, kv in zip(sids, kv_lens.tolist())]
    masks = [(torch.arange(kv) <= torch.arange(kv - hi + lo, kv)[:, None]).to(cache.k.device)
             for (lo, hi), kv in zip(spans, kv_lens.tolist())]

    def attend(layer, q, kv):
        cache.kv[:, layer, slots] = kv.transpose(0, 1)
        outs = []
        for (lo, hi), where, mask in zip(spans, key_slots, masks):
            keys, values = cache.k[layer][where], cache.v[layer][where]  # [kv, kv_heads, D]
            out = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)
    return attend


class PoolShape(NamedTuple):
    """What capacity checks read of an engine before any weight loads (eval.pool_shape): its
    tokenizer, device, context and block size, with the Engine's own block arithmetic."""
    tokenizer: object
    device: torch.device
    max_len: int
    block_size: int

    def blocks_for(self, tokens, copy_on_write=False):
        return blocks_for(tokens, self.block_size, copy_on_write)


class PagedCache:
    """A pool of KV blocks shared by many sequences through block tables and reference counts.

    Outside a generate call a sequence's table holds exactly the blocks its length needs. One
    more block, `scratch`, is never handed out: the fast path's padded decode rows write there."""

    def __init__(self, n_layers, n_kv_heads, head_dim, num_blocks, block_size, dtype, device):
        shape = (2, n_layers, (num_blocks + 1) * block_size, n_kv_heads, head_dim)
        self.kv = zero_pool(shape, dtype, device)  # keys and values: one write stores both
        self.k, self.v = self.kv[0], self.kv[1]
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
        index = index.to(self.kv.device)
        sources, targets, zero = index[:n], index[n:2 * n], index[2 * n:]
        blocks = self.kv.view(*self.kv.shape[:2], self.num_blocks + 1, bs, *self.kv.shape[3:])
        if n:
            blocks[:, :, targets] = blocks[:, :, sources]
        # attention reads whole blocks and masks the unwritten tail, but a masked NaN or inf
        # left in reused memory would still poison the softmax (0 * inf), so zero it
        if len(zero):
            blocks[:, :, zero] = 0

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
                 decode_capacity=None, cache_bytes=None, fast_path=None, sdpa_backends=None,
                 forward_tokens=FORWARD_TOKENS):
        """num_blocks or cache_bytes: the KV pool (default CACHE_GB_CPU, or CACHE_FRACTION_GPU of
        free memory; at most MAX_BLOCKS blocks); fast_path: decode and attention on
        lab/fastpath.py (default FAST_PATH), whose decode memory decode_bytes and decode_capacity
        size (lab.fastpath.FastPath). train.py passes its memory plan's figures for the three.
        sdpa_backends: the SDPA kernels attention may use (default layers.SDPA_BACKENDS);
        forward_tokens: the most new tokens one forward runs (token_chunks)."""
        self.model, self.tokenizer, self.sdpa_backends = model, tokenizer, sdpa_backends
        self.forward_tokens = forward_tokens
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        fast = FAST_PATH if fast_path is None else fast_path
        self.block_size = block_size or block_size_for(self.device, self.dtype, fast)
        cuda = self.device.type == "cuda"
        free = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        self.fast = (fastpath.FastPath(self, sample, free, decode_bytes, decode_capacity)
                     if fast else None)
        self.refresh()
        w = self.w
        self.token_bytes = 2 * len(w["layers"]) * w["n_kv_heads"] * w["head_dim"] * self.dtype.itemsize
        if num_blocks is None:
            budget = cache_bytes or (free * CACHE_FRACTION_GPU if cuda else CACHE_GB_CPU * 2**30)
            num_blocks = min(int(budget // (self.token_bytes * self.block_size)), MAX_BLOCKS)
        self.cache = PagedCache(len(w["layers"]), w["n_kv_heads"], w["head_dim"], num_blocks,
                                self.block_size, self.dtype, self.device)
        self.pending = {}
        self.stop_ids = stop_ids(model, tokenizer) if tokenizer is not None else []
        self.tokens_prefilled = 0

    def threads(self):
        """The torch threads this engine's next forward or decode window runs on (cpu_threads)."""
        return cpu_threads(self.device)

    def refresh(self, model=None):
        """Read the model's current weights. The fused tensors are the model's own storage
        (layers.fuse), so weights written into the model in place (train.copy_weights, an
        optimizer step) are what the engine reads, at the same addresses (the fast path's CUDA
        graphs stay valid; only its CPU-packed layouts are rebuilt). `model`, another model of the
        same shapes, has its weights copied into this one's."""
        if model is not None and model is not self.model:
            with torch.no_grad():
                mine = dict(self.model.named_parameters())
                for name, p in model.named_parameters():
                    mine[name].copy_(p)
        self.w = layers.fused_weights(self.model)
        if self.fast is not None:
            self.w = self.fast.refresh(self.w, tuple(p.data_ptr() for p in self.model.parameters()))

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
        written: a batch the pool cannot take raises and leaves every sequence as it was. The
        batch runs in chunks of at most forward_tokens new tokens (token_chunks)."""
        cache, sids = self.cache, list(sids)
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
        with self.threads():
            logits = torch.cat([self._forward_chunk(sids[a:b], news[a:b], starts[a:b])
                                for a, b in token_chunks(counts, self.forward_tokens)])
        for s, n in zip(sids, counts):
            cache.lengths[s] += n
            self.pending[s] = []
        return logits.float()

    def _forward_chunk(self, sids, news, starts):
        """One forward of these sequences' new tokens (their blocks reserved), written into the
        cache; their last-token logits."""
        w, cache = self.w, self.cache
        counts = [len(t) for t in news]
        q_lens = torch.tensor(counts)
        kv_lens = torch.tensor(starts) + q_lens
        ids = torch.tensor([t for toks in news for t in toks], device=self.device)
        positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, news)])
        slots = torch.cat([cache.slots(s, st, len(t)) for s, st, t in zip(sids, starts, news)])
        if self.fast is None:
            attend = paged_attention(cache, sids, slots.to(self.device), q_lens, kv_lens)
        else:
            attend = self.fast.attention(sids, q_lens, kv_lens, positions, slots,
                                         self.device.type in COMPUTE_BOUND_DEVICES)
        x = layers.decoder(w, ids, positions.to(self.device), attend, self.sdpa_backends)
        last = torch.cumsum(q_lens, 0).to(self.device) - 1
        self.tokens_prefilled += len(ids)
        return layers.lm_logits(w, x[last])

    def generate(self, sids, max_new_tokens=None, sampling=GREEDY, keys=None, stop_ids=None):
        """Sample a message of at most max_new_tokens (default MAX_NEW_TOKENS) tokens for each
        sequence after its pending tokens.

        keys[i] is sequence i's random stream (stream_key); token j of a sequence is drawn from
        noise keyed by (key, position), so what a sequence samples does not depend on the rows
        beside it. The first step runs every pending token in one ragged forward; the rest run
        one token a forward (decode_loop), or on the fast path's decode batches.

        Returns, per sequence, (token ids, log-probs, finish reason): "stop" (the stop token is
        the last id), "length", "context" (the model's context is full) or "cache" (the pool
        could not take its next tokens; it ends cleanly with what it has). The last sampled
        token stays pending in the sequence."""
        stop = set(self.stop_ids if stop_ids is None else stop_ids)
        max_new_tokens = MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        keys = dict(zip(sids, keys if keys is not None else [0] * len(sids)))
        out = {s: ([], [], None) for s in sids}
        active = self.step(list(sids), [len(self.pending[s]) for s in sids], max_new_tokens,
                           sampling, keys, out, stop)
        if self.fast is None:
            self.decode_loop(active, max_new_tokens, sampling, keys, out, stop)
        else:
            self.fast.decode(active, max_new_tokens, sampling, keys, out, stop)
        for s in sids:
            self.cache.trim(s)
        return [out[s] for s in sids]

    def _tensor(self, values):
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def admit_step(self, sids, counts, out):
        """The sequences whose next counts[i] tokens fit, in order; the others end, "context"
        where the model's context is full, else "cache" (nothing frees blocks inside a call)."""
        fits = [s for s, n in zip(sids, counts) if self.cached(s) + n <= self.max_len]
        for s in set(sids) - set(fits):
            out[s] = (*out[s][:2], "context")
        taken = self.admit(fits, [n for s, n in zip(sids, counts) if s in fits])
        for s in set(fits) - set(taken):
            out[s] = (*out[s][:2], "cache")
        return taken

    def take(self, sid, tokens, logps, out, stop, max_new_tokens):
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

    def step(self, sids, counts, max_new_tokens, sampling, keys, out, stop):
        """One ragged forward of the sequences whose next counts[i] tokens fit, and a sample
        each; returns those still going."""
        running = self.admit_step(sids, counts, out)
        if not running:
            return []
        logits = self.forward(running)
        tokens, logps = sample(logits, sampling, self._tensor([keys[s] for s in running]),
                               self._tensor([self.cached(s) for s in running]))
        for s, t, lp in zip(running, tokens.tolist(), logps.tolist()):
            self.take(s, [t], [lp], out, stop, max_new_tokens)
        return [s for s in running if out[s][2] is None]

    def decode_loop(self, sids, max_new_tokens, sampling, keys, out, stop):
        """The plain decode loop: a forward of every sequence's last token, a sample each, until
        each has ended (the fast path's too, for a row its decode memory cannot hold)."""
        active = list(sids)
        while active:
            active = self.step(active, [1] * len(active), max_new_tokens, sampling, keys, out,
                               stop)


# -----------------------------------------------------------------------------
# token ids in, token ids out


def generate(model, prompts, max_new_tokens, sampling=GREEDY, stop_ids=None, seed=0,
             block_size=None, fast_path=None):
    """Token ids in, token ids out, through the paged engine (stop token kept, like HF); prompt
    i samples from the stream stream_key(seed, i). fast_path: Engine's (default FAST_PATH)."""
    engine = Engine(model, block_size=block_size, fast_path=fast_path)
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
