"""
lab/padded.py: the padded attention path's SDPA calls (lab.fastpath.Batch on a GPU without
flash-attn). A ragged forward's sequences are padded on the left to one query width, each kv
head's G query heads folded into the query rows, and SDPA runs over whole gathered blocks with
an additive mask, in calls of bounded memory:

    out = softmax(q K^T / sqrt(d) + mask) V,  mask[r, j] = 0 if j <= pos(r) and j < kv_len else -inf
    bytes of a call = rows x (itemsize x (width G keys + 2 keys kv_heads d + 2 width heads d)
                      + 4 width heads)                                            (call_bytes)

A run of whole sequences goes into one call while it fits the budget; a sequence too large alone
is split into windows of its queries (padded_calls).

    python -m pytest -q tests/test_plan.py tests/test_engine.py
"""
import itertools
import math
from typing import NamedTuple

import torch


def round_up(n, multiple):
    return -(-n // multiple) * multiple


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
                                  round_up(max(kv[b:e + 1]), block_size)) <= budget:
            e += 1
        if e - b > 1 or cost(1, q[b], round_up(kv[b], block_size)) <= budget:
            spans.append((b, e, 0, max(q[b:e])))
        else:  # the keys fixed, the queries in windows that fit (one row at the least)
            keys = round_up(kv[b], block_size)
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
        n_blocks = round_up(int(lens.max()), block_size) // block_size
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
