"""
lab/triton_kernels.py: the Triton kernels behind lab.kernels' custom ops (imported by lab.kernels
at its first Triton launch only: this module imports triton). What each computes, its equation and
how it is tested: lab/kernels.py's docstring. Every intermediate the composites round to the
model's dtype is rounded here too (rounded), so a kernel differs from its composite only by
float32 reduction order and exp.
"""
import triton
import triton.language as tl


@triton.jit
def rounded(x, dt: tl.constexpr):
    """float32 x rounded to the nearest dt value (ties to even), kept in float32; bfloat16 by
    its bits, as the hardware rounds (Triton 3.6's interpreter truncates a bfloat16 cast)."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def rope_store_kernel(qkv, cos, sin, q_norm, k_norm, q_out, keys_t, values, rows, column,
                      qkv_stride, cos_stride, eps, kt_row, kt_head, kt_dim, kt_col,
                      v_row, v_head, v_col, v_dim,
                      H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    n, j = tl.program_id(0).to(tl.int64), tl.program_id(1)  # token, head slot (q, k, v heads)
    dt = qkv.dtype.element_ty
    d = tl.arange(0, D)
    src = qkv + n * qkv_stride + j * D
    row, col = tl.load(rows + n), tl.load(column + n)
    if j >= H + HKV:  # a value head: stored as it is
        h = j - H - HKV
        tl.store(values + row * v_row + h * v_head + col * v_col + d * v_dim, tl.load(src + d))
    else:
        rolled = (d + D // 2) % D
        x, xr = tl.load(src + d).to(tl.float32), tl.load(src + rolled).to(tl.float32)
        if NORM:  # as F.rms_norm: x / rms(x) * weight in float32, rounded once
            inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
            is_q = j < H
            w = tl.where(is_q, tl.load(q_norm + d), tl.load(k_norm + d)).to(tl.float32)
            wr = tl.where(is_q, tl.load(q_norm + rolled), tl.load(k_norm + rolled)).to(tl.float32)
            x = rounded(x * inv * w, dt)
            xr = rounded(xr * inv * wr, dt)
        c = tl.load(cos + n * cos_stride + d).to(tl.float32)
        s = tl.load(sin + n * cos_stride + d).to(tl.float32)
        out = rounded(rounded(x * c, dt) + rounded(xr * s, dt), dt).to(dt)
        if j < H:
            tl.store(q_out + (n * H + j) * D + d, out)
        else:
            tl.store(keys_t + row * kt_row + (j - H) * kt_head + d * kt_dim + col * kt_col, out)


@triton.jit
def attention_kernel(q, keys_t, values, bias, out, part_max, part_sum, part_acc, K, scale,
                     kt_row, kt_head, kt_dim, v_row, v_head, v_col, bias_row,
                     H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     SPAN: tl.constexpr, SPLIT: tl.constexpr):
    """One (row, query head, span of SPAN keys from column span * SPAN): an online softmax over
    the span's chunks of BLOCK; with SPLIT, its running max, sum and weighted values go to the
    partials for attention_combine_kernel, else the output is written."""
    b, h, span = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    kvh = h // G
    d = tl.arange(0, D)
    qv = tl.load(q + (b * H + h) * D + d).to(tl.float32)
    m = tl.full((), -float("inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    k0 = span * SPAN
    end = tl.minimum(k0 + SPAN, K)
    while k0 < end:  # not `for in range(K)`: Triton 3.6's interpreter fails on it (numpy 2)
        kk = k0 + tl.arange(0, BLOCK)
        valid = kk < end  # SPAN is a multiple of BLOCK: the same lanes as kk < K
        kt = tl.load(keys_t + b * kt_row + kvh * kt_head + d[:, None] * kt_dim + kk[None, :],
                     mask=valid[None, :], other=0.0).to(tl.float32)
        scores = tl.sum(qv[:, None] * kt, 0) * scale + tl.load(
            bias + (b * (H // G) + kvh) * bias_row + kk, mask=valid, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe)
        alpha = tl.exp(m - m_safe)
        v = tl.load(values + b * v_row + kvh * v_head + kk[:, None] * v_col + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        total = total * alpha + tl.sum(p, 0)
        m = m_new
        k0 += BLOCK
    if SPLIT:
        at = (b * H + h) * tl.num_programs(2) + span
        tl.store(part_max + at, m)
        tl.store(part_sum + at, total)
        tl.store(part_acc + at * D + d, acc)
    else:
        dt = out.dtype.element_ty
        tl.store(out + (b * H + h) * D + d, rounded(acc / total, dt).to(dt))


@triton.jit
def attention_combine_kernel(part_max, part_sum, part_acc, out, spans,
                             H: tl.constexpr, D: tl.constexpr):
    """One (row, query head): its spans' partials rescaled to their common max and summed in span
    order. A span past the row's keys (max -inf) adds exactly 0, and a row whose keys fill one
    span gets the very bits the unsplit kernel writes (its weight is exp(0) = 1)."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    first = (b * H + h) * spans
    d = tl.arange(0, D)
    m = tl.full((), -float("inf"), tl.float32)
    s = 0
    while s < spans:
        m = tl.maximum(m, tl.load(part_max + first + s))
        s += 1
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    s = 0
    while s < spans:
        w = tl.exp(tl.load(part_max + first + s) - m_safe)
        total += w * tl.load(part_sum + first + s)
        acc += w * tl.load(part_acc + (first + s) * D + d)
        s += 1
    dt = out.dtype.element_ty
    tl.store(out + (b * H + h) * D + d, rounded(acc / total, dt).to(dt))


@triton.jit
def silu_mul_kernel(gate_up, out, width, stride, BLOCK: tl.constexpr):
    n, c = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dt = gate_up.dtype.element_ty
    ok = c < width
    gate = tl.load(gate_up + n * stride + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up + n * stride + width + c, mask=ok, other=0.0).to(tl.float32)
    act = rounded(gate / (1.0 + tl.exp(-gate)), dt)
    tl.store(out + n * width + c, rounded(act * up, dt).to(dt), mask=ok)
