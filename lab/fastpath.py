"""
lab/fastpath.py: the engine's fast path. engine.py is the reference (paged attention that reads
the pool through the block tables, one plain decode step at a time); everything here computes
the same tokens faster, and engine.FAST_PATH (or Engine(fast_path=False)) turns it off.

    prefill  Batch: one ragged forward with attention on one of four paths:
               flash   flash-attn's paged kernels (installed, CUDA, fp16/bf16, blocks of
                       FLASH_BLOCK_SIZE): they read the pool through the block tables
               padded  PyTorch SDPA elsewhere on a GPU: whole blocks gathered, queries padded on
                       the left, grouped query heads folded into the query rows, in calls of at
                       most ATTENTION_CALL_MB (lab/padded.py)
               split   on a compute-bound device (a CPU): one SDPA call a sequence, no padding
               decode  ... and one query a sequence: two batched products (kernels.decode_attention)
    decode   DecodeBatch: a fixed shape per batch bucket (BATCH_BUCKETS, then multiples of
             BATCH_STEP), a dense copy of the batch's cache in the engine's one decode memory
             (DECODE_COPY_GB, or DECODE_COPY_FRACTION_GPU of free memory), host checks every
             SYNC_EVERY steps, and on CUDA one CUDA graph per bucket, sampling and capacity tier
             (CAPACITY_TIERS), captured once for the engine's life (eager steps if one fails):
                 scores = q K^T / sqrt(d) + bias (float32),  out = softmax(scores) V
             over the dense keys (two batched products a layer, batch-invariant where one SDPA
             call is not), each layer writing its token's keys and values into the copy, each
             step every layer's into the pool after the layers. With FUSED_KERNELS, RoPE and
             the copy's write, the attention and silu * up are lab.kernels' operators (one
             Triton kernel each on CUDA, the same composites elsewhere).
             On a CPU a window runs on the cores other processes leave free (engine.cpu_threads).
    weights  on a CPU the products' weights in oneDNN's prepacked layout (lab/cpu_products.py).

It never imports engine.py: an Engine hands itself over (duck-typed: its cache, weights,
pending tokens, admit_step, take, decode_loop) with its sampling function.

    python -m pytest -q tests/test_engine.py      # every equivalence test on both paths
    python -m lab.bench                           # the rollout workload (the fast path)
"""
import functools
import math
import sys
import time
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from persuarena import layers
from lab import cpu_products, kernels
from lab.padded import call_bytes, call_mask, padded_calls, round_up  # noqa: F401 (fastpath.round_up)

FLASH_BLOCK_SIZE = 256    # tokens per KV block with flash-attn's paged kernels (divisible by 256)
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
EXTENT_MULTIPLE = 16      # ... rounded up to a multiple of this: a CPU score product's last few
# columns round unlike the same columns inside a wider one, so a row's scores would move with the
# batch's longest row (DECISIONS.md: Decode fusion)
DECODE_PAD = 16           # columns after a row's capacity: its scratch column, and padding that
# starts every transposed key row 32-byte aligned (cuBLAS reads aligned rows; capacity + 1 did not)
ATTENTION_CALL_MB = 256   # the padded path's largest SDPA call (mask, gathered keys, queries; call_bytes):
# a forward past it runs in several calls (whole sequences, or windows of one's queries)
FUSED_KERNELS = True      # a decode step's RoPE + store, attention and silu * up as lab.kernels'
# custom ops (one Triton kernel each on CUDA; the same composites elsewhere), else the composites

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None


def flash_usable(device, dtype):
    """flash-attn's paged kernels can run: installed, on CUDA, fp16 or bf16 (FlashAttention-2's)."""
    return (flash_attn_with_kvcache is not None and torch.device(device).type == "cuda"
            and dtype in (torch.float16, torch.bfloat16))


def flash_block_size(device, dtype):
    """FLASH_BLOCK_SIZE where flash-attn's kernels can run on `device` in `dtype`, else None."""
    return FLASH_BLOCK_SIZE if flash_usable(device, dtype) else None


def attention_transient_bytes(heads, decode_columns, itemsize):
    """The most memory attention takes beside the pool and the decode memory, in bytes: one padded-path
    SDPA call (ATTENTION_CALL_MB, call_bytes: its mask, folded queries and output, and the
    gathered keys and values the engine keeps for the next call) and the masks a forward keeps
    (at most as much again, Batch), plus a decode step's float32 scores, their softmax and its
    cast (one layer at a time, heads x every decode memory column)."""
    return int(2 * ATTENTION_CALL_MB * 2**20) + decode_columns * heads * (8 + itemsize)


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
# an engine's fast path: its weights' layout, its ragged forward, its decode batches


class FastPath:
    """What an engine's fast path holds beside the engine: its decode batches (one a bucket, and
    on CUDA their graphs), the one decode memory they view, the gather memory of the ragged
    forward, and the addresses of the weights the graphs captured.

    engine: the Engine (held weakly: it holds this); sample: engine.sample; free: free device
    memory before the engine's pool was made (sizes the decode memory on a GPU); decode_bytes,
    decode_capacity: Engine's arguments of those names."""

    def __init__(self, engine, sample, free, decode_bytes=None, decode_capacity=None):
        self.engine, self.sample, cuda = weakref.proxy(engine), sample, engine.device.type == "cuda"
        self.use_flash = (flash_usable(engine.device, engine.dtype)
                          and engine.block_size % FLASH_BLOCK_SIZE == 0)
        if decode_bytes is None:
            decode_bytes = free * DECODE_COPY_FRACTION_GPU if cuda else DECODE_COPY_GB * 2**30
        self.decode_bytes, self.capacity_asked = int(decode_bytes), decode_capacity
        self.decode_batches = {}  # batch bucket -> DecodeBatch (and its graphs), for the engine's life
        self.addresses = ()  # of the model's parameters, which the graphs captured
        self.copy_rows = (None, [])  # what the decode memory's rows hold (decode_memory_rows)
        self.decode_memory = None  # [2, decode_bytes / 2 elements]: keys, values (decode_memory_views)
        self.graph_pool = self.side_stream = None  # CUDA: one graph pool, one capture stream
        self.gather_buffers = [None, None]  # Batch.gather's keys and values
        self.graph_capture_s, self.capture_failed = 0.0, False  # capturing decode graphs (CUDA)
        # this engine's CUDA_GRAPHS, DECODE_EXTENT and FUSED_KERNELS where set (lab.bench compares
        # them on one engine); None: the constants, read each run
        self.cuda_graphs = self.decode_extent = self.fused_kernels = None

    @property
    def decode_capacity(self):
        """The most tokens a decode memory row holds: decode_capacity, default the model's context
        and a window, rounded up to CAPACITY_BUCKET."""
        return round_up(self.capacity_asked or self.engine.max_len + SYNC_EVERY, CAPACITY_BUCKET)

    def refresh(self, w, addresses):
        """The engine's weights as the fast path reads them (cpu_products.pack_weights); storage
        that moved (a model moved or reloaded) drops the decode batches, whose graphs hold the old
        addresses."""
        if addresses != self.addresses:
            self.decode_batches = {}
        self.addresses = addresses
        self.copy_rows = (None, [])
        return cpu_products.pack_weights(w)

    def attention(self, sids, q_lens, kv_lens, positions, slots, compute_bound):
        """The ragged forward's attention over these sequences (Batch.attention)."""
        return Batch(self, sids, q_lens, kv_lens, positions, slots, compute_bound).attention

    def decode(self, active, max_new_tokens, sampling, keys, out, stop):
        """Decode the sequences still going to their end on DecodeBatch windows: another batch
        whenever the sequences left fit a smaller bucket, the engine's plain decode loop for a
        row the decode memory cannot hold."""
        eng = self.engine
        while active:
            reach = self.reach(active, max_new_tokens)
            rows = len(active)  # as many rows a DecodeBatch as decode memory holds at this reach
            while rows and self.decode_capacity_for(batch_bucket(rows)) < reach:
                rows -= 1
            if not rows:  # one row would not fit the decode memory: the ragged forward, step by step
                eng.decode_loop(active, max_new_tokens, sampling, keys, out, stop)
            for i in range(0, len(active), rows) if rows else ():
                self.decode_windows(active[i:i + rows], max_new_tokens, sampling, keys, out, stop)
            active = [s for s in active if out[s][2] is None]

    def decode_capacity_for(self, rows):
        """Tokens each row of a `rows`-row DecodeBatch holds in the decode memory: what
        decode_bytes gives a row (one scratch column kept), rounded down to CAPACITY_BUCKET, at most
        decode_capacity. Fixed per bucket, so a bucket's CUDA graph is captured once."""
        columns = self.decode_bytes // (self.engine.token_bytes * rows) - DECODE_PAD
        return min(columns // CAPACITY_BUCKET * CAPACITY_BUCKET, self.decode_capacity)

    def decode_memory_views(self, n):
        """Keys and values of a DecodeBatch, n elements each, as one [2, n] view (keys, values) of the engine's one
        decode memory of decode_bytes, allocated at first use and never again (every bucket views it).
        On a CPU it is left untouched until used (fresh memory costs its first touch: zero-filling
        an 8-row copy took 0.25 s of page faults); on CUDA it starts zeroed, since a graph step
        reads every column up to the capacity and masks the unwritten ones, which must be finite."""
        if self.decode_memory is None:
            eng = self.engine
            per_side = self.decode_bytes // (2 * eng.dtype.itemsize)
            make = eng.cache.k.new_zeros if eng.device.type == "cuda" else eng.cache.k.new_empty
            self.decode_memory = make(2, per_side)
        return self.decode_memory[:, :n]

    def decode_memory_rows(self, rows):
        """What each decode memory row holds for a `rows`-row DecodeBatch (DecodeBatch.filled):
        kept while batches of this bucket use it, reset once another bucket's view wrote it."""
        if self.copy_rows[0] != rows:
            self.copy_rows = (rows, [None] * rows)
        return self.copy_rows[1]

    def gather_memory(self, side, n):
        """n elements for one layer's gathered keys (side 0) or values (side 1) in a ragged
        forward, reused by every layer and forward: a fresh copy each layer paid its page faults
        every time (an 18 MB probe-read gather took 1.9 ms fresh, 0.6 ms into kept memory)."""
        if self.gather_buffers[side] is None or self.gather_buffers[side].numel() < n:
            self.gather_buffers[side] = None
            self.gather_buffers[side] = self.engine.cache.k.new_empty(n)
        return self.gather_buffers[side][:n]

    def reach(self, sids, max_new_tokens):
        """Past the last position any decode step of these sequences can write or read."""
        eng = self.engine
        return min(max(map(eng.cached, sids)) + max_new_tokens, eng.max_len) + SYNC_EVERY

    def decode_windows(self, sids, max_new_tokens, sampling, keys, out, stop):
        """Decode windows of SYNC_EVERY fixed-shape steps until every sequence has ended, or
        until those left fit a smaller batch bucket (finished rows still cost compute)."""
        eng, bucket = self.engine, batch_bucket(len(sids))
        if bucket not in self.decode_batches:  # one a bucket, for the engine's life
            self.decode_batches[bucket] = DecodeBatch(self, bucket, self.decode_capacity_for(bucket))
        batch = self.decode_batches[bucket]
        batch.begin(sids, min(batch.capacity, self.reach(sids, max_new_tokens)))
        active = list(sids)
        while active:
            room = [min(SYNC_EVERY, max_new_tokens - len(out[s][0]), eng.max_len - eng.cached(s))
                    for s in active]
            for s, n in zip(active, room):
                if n <= 0:  # the model's context is full
                    out[s] = (*out[s][:2], "context")
            room = {s: n for s, n in zip(active, room) if n > 0}
            active = list(room)
            running = eng.admit_step(active, [room[s] for s in active], out)
            if not running:
                return
            steps = max(room[s] for s in running)
            eng.cache.reserve(running, [room[s] for s in running])
            tokens, logps = batch.run(running, [keys[s] for s in running], steps, sampling)
            for s in running:
                row, n = batch.sids.index(s), room[s]
                taken = eng.take(s, tokens[row][:n], logps[row][:n], out, stop, max_new_tokens)
                eng.cache.lengths[s] += taken  # each step wrote its input token
                eng.tokens_prefilled += taken
                batch.filled[row] = (s, eng.cache.lengths[s])
            active = [s for s in active if out[s][2] is None]
            if active and batch_bucket(len(active)) < bucket:
                return


class Batch:
    """Per-forward attention metadata: where each sequence's new keys go and its keys come from.

    This is the ragged, eager forward (prefill, probe forks, and decode where no DecodeBatch
    fits); generate's decode steps run on DecodeBatch. Attention takes one of four paths:
      flash   flash-attn reads the pool through the block tables (queries padded on the left)
      padded  PyTorch elsewhere on a GPU: blocks gathered, one SDPA call, queries padded on the
              left and a mask (few kernel launches, which is what counts there)
    and on a compute-bound device (engine.COMPUTE_BOUND_DEVICES: a CPU), where padding costs
    compute and calls are cheap:
      split   prefill: one SDPA call a sequence over its gathered keys, no padding
      decode  one query a sequence: two batched products over its gathered blocks"""

    def __init__(self, fast, sids, q_lens, kv_lens, positions, slots, compute_bound):
        engine = fast.engine
        cache, dev = engine.cache, engine.device
        self.fast, self.engine, self.slots = fast, engine, slots.to(dev)
        self.kv_lens = kv_lens
        B, bs = len(sids), cache.block_size
        self.q_max, self.kv_max = int(q_lens.max()), int(kv_lens.max())
        if fast.use_flash:
            self.path = "flash"
        elif not compute_bound:
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
        the engine keeps (FastPath.gather_memory)."""
        tables = self.tables if tables is None else tables
        B, n_blocks = tables.shape
        blocks = pool.view(-1, self.engine.cache.block_size, *pool.shape[1:])
        out = self.fast.gather_memory(side, B * n_blocks * blocks[0].numel())
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

    def attention(self, layer, q, kv):
        """Write this step's keys and values kv [N, 2, kv_heads, D] into the pool, then attend
        over each sequence's whole cache."""
        cache = self.engine.cache
        cache.kv[:, layer, self.slots] = kv.transpose(0, 1)
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
            return kernels.decode_attention(q, keys.permute(0, 2, 3, 1), values.transpose(1, 2),
                                            self.bias)
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


class DecodeBatch:
    """Fixed-shape decode steps for one batch bucket: every tensor a step reads lives here or in
    the engine's decode memory on the device and keeps its shape and address, so that on CUDA a
    step is captured once as a graph (per sampling) and replayed for the engine's life, weight
    refreshes included; on a CPU the same step runs eagerly.

        rows      B = the bucket; rows past the sequences and rows not running are padded and
                  inert: they write into the pool's scratch block and the copy's scratch column,
                  their position does not move, their samples are discarded
        capacity  FastPath.decode_capacity_for(B) tokens a row, fixed for the bucket; a graph step
                  attends over all of them (the unwritten ones masked), an eager step over the
                  columns its positions reach
        keys_t    each row's keys, dense and transposed [layers, B, kv_heads, head_dim, capacity +
                  DECODE_PAD] (decode_attention; every key row 32-byte aligned, column capacity
                  the scratch one), and values [layers, B, kv_heads, capacity + DECODE_PAD, head_dim]:
        values    views of the engine's one decode memory (FastPath.decode_memory_views), copied
                  from the pool and kept between calls (filled); each step writes its token into
                  both (the pool once a step, after the layers), so the pool stays the cache
                  of record
        filled    per row, (sequence, tokens of it the row holds): a row that holds its sequence's
                  first tokens from the last call takes only the tokens cached since; reset when
                  another bucket's view wrote the decode memory (FastPath.decode_memory_rows)
        metadata  tokens, positions, the running mask, stream keys and block tables, written from
                  the host once a window of SYNC_EVERY steps; the mask of visible keys is built on
                  the device from the positions"""

    def __init__(self, fast, rows, capacity):
        engine = fast.engine
        cache, dev = engine.cache, engine.device
        # weak references: the engine keeps its batches, and a cycle would keep its pool alive
        # until the garbage collector (or interpreter shutdown) came to it
        self.fast, self.engine = weakref.proxy(fast), engine
        self.capacity, self.block_size = capacity, cache.block_size
        n_layers, _, kv_heads, head_dim = cache.k.shape
        keys_shape = (n_layers, rows, kv_heads, head_dim, capacity + DECODE_PAD)
        values_shape = (n_layers, rows, kv_heads, capacity + DECODE_PAD, head_dim)
        keys, values = fast.decode_memory_views(math.prod(values_shape))
        self.keys_t, self.values = keys.view(keys_shape), values.view(values_shape)
        self.filled = fast.decode_memory_rows(rows)
        new = lambda fill=0, dtype=torch.long: torch.full((rows,), fill, dtype=dtype, device=dev)
        self.tokens, self.positions, self.keys = new(), new(), new()
        self.live = new(False, torch.bool)
        self.tables = torch.full((rows, capacity // cache.block_size + 1), cache.scratch,
                                 dtype=torch.long, device=dev)
        self.rows, self.kv_pos = torch.arange(rows, device=dev), torch.arange(capacity, device=dev)
        self.tiers = capacity_tiers(capacity)
        self.graphs = {}  # (sampling, tier, fused) -> (graph, outputs)

    def begin(self, sids, limit):
        """Bring the dense copy up to date with these sequences' cached keys and values: a row
        that already holds the first tokens of its sequence (the same sequence last call) takes
        only the tokens cached since. Columns from a row's length up to `limit` (beyond any key
        the coming steps reach, rounded up to its capacity tier, which a step may read) are
        zeroed: memory never written may hold anything, and a masked key's weight is 0 only
        when its value is finite."""
        limit = self.tier(limit)
        cache, self.sids = self.engine.cache, list(sids)
        self.filled = self.fast.decode_memory_rows(len(self.tokens))
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

        ops = kernels.decode_ops(self.fused())

        def rope_store(layer, qkv, cos, sin):  # RoPE, and k and v into the decode copy
            lw = w["layers"][layer]
            return ops.qk_rope_store(qkv, cos, sin, lw.get("q_norm"), lw.get("k_norm"), w["eps"],
                                     w["n_heads"], self.keys_t[layer], self.values[layer],
                                     self.rows, column)

        def attend(layer, q, kv):  # kv None: rope_store stored them
            return ops.decode_attention(q, self.keys_t[layer][..., :extent],
                                        self.values[layer][:, :, :extent], bias)

        hooks = SimpleNamespace(rope_store=rope_store, silu_mul=ops.silu_mul)
        logits = layers.lm_logits(w, layers.decoder(w, self.tokens, pos, attend,
                                                    self.engine.sdpa_backends, hooks))
        # every layer's keys and values of this step into the pool, in one write
        cache.k[:, slots] = self.keys_t[:, self.rows, :, :, column].transpose(0, 1)
        cache.v[:, slots] = self.values[:, self.rows, :, column].transpose(0, 1)
        tokens, logps = self.fast.sample(logits, sampling, self.keys, pos + 1)
        self.tokens.copy_(torch.where(self.live, tokens, self.tokens))
        self.positions.add_(self.live.long())
        return tokens, logps

    @torch.no_grad()
    def run(self, running, keys, steps, sampling):
        """`steps` decode steps of the running sequences; tokens and log-probs per row as lists,
        read back once."""
        start = self.load(running, keys)
        fast = self.fast
        extent = DECODE_EXTENT if fast.decode_extent is None else fast.decode_extent
        tokens = torch.empty(len(self.tokens), steps, dtype=torch.long, device=self.tokens.device)
        logps = torch.empty(tokens.shape, dtype=torch.float32, device=self.tokens.device)
        tier = self.tier(start + steps)  # the columns the window's last step reaches
        with self.engine.threads():  # the cores free now (engine.cpu_threads)
            for j in range(steps):
                live = min(round_up(start + j + 1, EXTENT_MULTIPLE), self.capacity)
                out = self.replay(sampling, tier) if self.uses_graphs() else None
                t, lp = out or self.step(tier if extent == "tier" else live, sampling)
                tokens[:, j], logps[:, j] = t, lp
        return tokens.tolist(), logps.tolist()

    def fused(self):
        """Whether steps run lab.kernels' custom ops (FUSED_KERNELS, or the engine's own setting)."""
        return FUSED_KERNELS if self.fast.fused_kernels is None else self.fast.fused_kernels

    def tier(self, reach):
        """The smallest of the bucket's capacity tiers (capacity_tiers) that holds `reach` columns."""
        return next((t for t in self.tiers if t >= reach), self.capacity)

    def uses_graphs(self):
        """Whether steps replay CUDA graphs: on CUDA with CUDA_GRAPHS (or the engine's own
        setting), unless a capture has failed in this engine (FastPath.capture_failed)."""
        fast = self.fast
        graphs = CUDA_GRAPHS if fast.cuda_graphs is None else fast.cuda_graphs
        return self.engine.device.type == "cuda" and graphs and not fast.capture_failed

    def replay(self, sampling, extent):
        """The step as a CUDA graph over `extent` columns (a capacity tier), captured on first use
        for this sampling and tier and kept for the engine's life: its tensors, the decode memory
        and the weights never move. A capture that fails (an operation a graph refuses) prints
        one warning line and returns None: this engine's steps then run eagerly for good."""
        key = (sampling, extent, self.fused())
        if key not in self.graphs:
            try:
                self.graphs[key] = self.capture(sampling, extent)
            except Exception as error:  # the run goes on eagerly, slower
                self.fast.capture_failed = True
                print(f"warning: lab.fastpath: a CUDA graph capture failed ({type(error).__name__}"
                      f": {str(error).splitlines()[0] if str(error) else ''}); this engine's decode "
                      "steps run eagerly", file=sys.stderr)
                return None
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def capture(self, sampling, extent):
        """(graph, its outputs) of one step, captured with every row inert (writing only scratch),
        in the thread-local capture mode (another thread's CUDA calls do not break it)."""
        start, live, fast = time.perf_counter(), self.live.clone(), self.fast
        self.live.zero_()
        try:
            if fast.graph_pool is None:  # one pool and one capture stream an engine
                fast.graph_pool = torch.cuda.graph_pool_handle()
                fast.side_stream = torch.cuda.Stream()
            side = fast.side_stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(extent, sampling)  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=fast.graph_pool, capture_error_mode="thread_local"):
                outputs = self.step(extent, sampling)
            return graph, outputs
        finally:
            self.live.copy_(live)
            fast.graph_capture_s += time.perf_counter() - start
