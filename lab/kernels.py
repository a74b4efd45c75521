"""
lab/kernels.py: the fast path's fused decode pieces, each one custom op (torch.library, namespace
"persuarena") that is one Triton kernel on CUDA and, everywhere else, the plain composite of
layers.py and decode_attention (the very aten ops, in the same order: every CPU result is
bit-identical with or without them).

    qk_rope_store     per token: (Qwen3) q_h <- RMSNorm(q_h) w_q, k_h <- RMSNorm(k_h) w_k, then
                      RoPE  x <- x cos + roll(x, D/2) signed_sin  on every q and k head;
                      keys_t[row, :, :, column] <- k,  values[row, :, column] <- v;
                      returns q [N, H, D] contiguous
    decode_attention  out_h = softmax(q_h K^T / sqrt(D) + bias) V over one row's keys, float32
                      scores, query head h reading kv head h // G (grouped-query attention)
    silu_mul          silu(gate) * up from the fused product's [gate | up]

The Triton attention splits a row's keys into spans of ATTENTION_SPAN from column 0, one program
a (row, query head, span) walking its span in fixed chunks of ATTENTION_BLOCK with a running max
and sum (online softmax); a second kernel combines the spans' partials,
    out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s,   M = max_s m_s
(flash-decoding), so a long context is read by many programs at once. A row's result never
depends on its batch or on the extent beyond its keys: its spans are fixed by its own columns,
masked lanes weigh exactly 0 and leave the running values untouched, and a span past its keys
adds exactly 0 to the combine (DECISIONS.md, Decode fusion). The scores are a broadcast multiply
and a sum, not tl.dot (a row has one query a head).

Triton is imported at the first CUDA call only. Where it is missing, where a kernel fails to
compile or its first output leaves its composite's by more than rounding (FIRST_USE_TOLERANCE;
one warning line, then the composite for the process's life), or with
lab.fastpath.FUSED_KERNELS off, the composites run. The kernels themselves also run on CPU
tensors under Triton's interpreter (the *_triton functions), which is how they are tested here:

    TRITON_INTERPRET=1 PYTHONPATH=<triton 3.6> python -m pytest -q tests/test_kernels.py
    python -m pytest -q tests/test_kernels.py          # the composites' equalities only
    python -m lab.bench --gpu-check                    # on a GPU: differences and step times
"""
import functools
import math
import os
import sys
from types import SimpleNamespace

import torch

from persuarena import layers

ATTENTION_BLOCK = 32   # keys a chunk of the Triton attention (fixed: batch invariance); fewer
# registers a thread than 64 on an H200, so more programs in flight (BENCHMARKS.md)
ATTENTION_SPAN = 256   # keys a program of it takes, spans fixed from column 0 (flash-decoding:
# long contexts spread over programs; a row's spans depend on its own length alone)
SILU_BLOCK = 1024      # intermediate columns a program of the Triton silu_mul
FIRST_USE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # a
# kernel's first output may leave its composite's by this, relative to the largest |value| + 1


def decode_attention(q, keys_t, values, key_bias, float32_scores=False):
    """softmax(q k^T / sqrt(d) + bias) v for one query per sequence: q [B, H, D], keys_t
    [B, kv_heads, D, K] (keys transposed: the score product then reads rows of K contiguous
    floats, ~25% faster on a CPU than reading keys across), values [B, kv_heads, K, D], key_bias
    float32 [B * kv_heads, 1, K] (0 where a key is visible, else -inf). Query head h*G + g reads
    kv head h (grouped-query attention), so each kv head meets its G queries in one product; on
    a CPU two batched products beat SDPA's kernel at one query. The softmax is float32 whatever
    the model's dtype, and so are the scores on CUDA (as in flash-attn and SDPA); a CPU's bf16
    score product sums in float32 and rounds each score once to bf16 (no float32 copy of the
    keys a layer: DECISIONS.md, The CPU's dtype). Not one
    SDPA call: the CPU's flash kernel rounds a row's output differently with the number of
    (masked) keys, which the batch's longest sequence sets, so an episode's numbers would depend
    on its batch neighbours (DECISIONS.md: Decode fusion). float32_scores: the GPU's float32
    scores on a CPU too (the reference the Triton kernels are checked against there)."""
    B, H, D = q.shape
    Hkv, K = keys_t.shape[1], keys_t.shape[3]
    q, keys_t = q.reshape(B * Hkv, H // Hkv, D), keys_t.reshape(B * Hkv, D, K)
    if q.dtype == torch.float32:
        scores = torch.baddbmm(key_bias, q, keys_t, alpha=D ** -0.5)
    elif q.is_cuda and fp32_products():  # half inputs, float32 out (cuBLAS accumulates in it)
        scores = torch.bmm(q, keys_t, out_dtype=torch.float32).mul_(D ** -0.5).add_(key_bias)
    elif not q.is_cuda and q.dtype == torch.bfloat16 and not float32_scores:
        # a CPU's bf16 product (float32 sums, the scores rounded once to bf16: no float32 copy
        # of the keys a layer), float32 softmax
        scores = torch.add(key_bias, torch.bmm(q, keys_t).float(), alpha=D ** -0.5)
    else:
        scores = torch.baddbmm(key_bias, q.float(), keys_t.float(), alpha=D ** -0.5)
    probs = torch.softmax(scores, -1).to(values.dtype)
    return torch.bmm(probs, values.reshape(B * Hkv, K, D)).view(B, H, D)


@functools.cache
def fp32_products():
    """Whether this PyTorch's CUDA bmm writes float32 from half inputs (out_dtype); checked once."""
    try:
        a = torch.ones(1, 1, 1, dtype=torch.bfloat16, device="cuda")
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def qk_rope_store_composite(qkv, cos, sin, q_norm, k_norm, eps, n_heads, keys_t, values, rows,
                            column):
    """layers.turn_qk (in place into qkv), then k and v of token n into keys_t [B, kv_heads, D,
    columns] and values [B, kv_heads, columns, D] at (rows[n], column[n]); q [N, H, D] copied out."""
    q, kv = layers.turn_qk(qkv, cos, sin, q_norm, k_norm, eps, n_heads, keys_t.shape[2])
    keys_t[rows, :, :, column] = kv[:, 0]
    values[rows, :, column] = kv[:, 1]
    return q.clone(memory_format=torch.contiguous_format)  # never a view: the operator's output


def decode_ops(fused):
    """The decode step's three pieces (qk_rope_store, decode_attention, silu_mul): the custom ops
    when `fused` (lab.fastpath.FUSED_KERNELS), else their composites called directly."""
    if not fused:
        return SimpleNamespace(qk_rope_store=qk_rope_store_composite,
                               decode_attention=decode_attention, silu_mul=layers.silu_mul)
    ops = torch.ops.persuarena
    return SimpleNamespace(qk_rope_store=ops.qk_rope_store, decode_attention=ops.decode_attention,
                           silu_mul=ops.silu_mul)


@functools.cache
def triton_kernels():
    """lab.triton_kernels (triton imported there, at first use), or None where Triton is missing."""
    try:
        from lab import triton_kernels as kern
    except ImportError:
        return None
    return kern


def check_head_dim(D, where):
    if D & (D - 1):
        raise ValueError(f"lab.kernels.{where}: head_dim {D} is not a power of two; the Triton "
                         "kernels need one (set lab.fastpath.FUSED_KERNELS = False)")


def qk_rope_store_triton(qkv, cos, sin, q_norm, k_norm, eps, n_heads, keys_t, values, rows,
                         column):
    """qk_rope_store as one Triton kernel (qkv left as it was); qkv rows contiguous."""
    kern = triton_kernels()
    N, (Hkv, D) = qkv.shape[0], keys_t.shape[1:3]
    check_head_dim(D, "qk_rope_store")
    assert qkv.stride(1) == 1 and cos.stride(2) == 1 and sin.stride() == cos.stride()
    q = qkv.new_empty(N, n_heads, D)
    norm = q_norm is not None
    kern.rope_store_kernel[(N, n_heads + 2 * Hkv)](
        qkv, cos, sin, q_norm if norm else qkv, k_norm if norm else qkv, q, keys_t, values, rows,
        column, qkv.stride(0), cos.stride(0), eps, *keys_t.stride(), *values.stride(),
        H=n_heads, HKV=Hkv, D=D, NORM=norm)
    return q


def decode_attention_triton(q, keys_t, values, key_bias):
    """decode_attention as Triton kernels: a program a (row, query head, span of ATTENTION_SPAN
    keys), then, where the extent holds more than one span, one a (row, query head) combining
    the spans' partials (flash-decoding)."""
    kern = triton_kernels()
    B, H, D = q.shape
    Hkv, K = keys_t.shape[1], keys_t.shape[3]
    check_head_dim(D, "decode_attention")
    assert q.is_contiguous() and keys_t.stride(3) == 1 and values.stride(3) == 1
    assert key_bias.stride(2) == 1 and ATTENTION_SPAN % ATTENTION_BLOCK == 0
    out, spans = q.new_empty(B, H, D), max(1, -(-K // ATTENTION_SPAN))
    parts = [q.new_empty(B, H, spans, *shape, dtype=torch.float32) for shape in ((), (), (D,))]
    kern.attention_kernel[(B, H, spans)](
        q, keys_t, values, key_bias, out, *parts, K, D ** -0.5, *keys_t.stride()[:3],
        *values.stride()[:3], key_bias.stride(0), H=H, G=H // Hkv, D=D, BLOCK=ATTENTION_BLOCK,
        SPAN=ATTENTION_SPAN, SPLIT=spans > 1)
    if spans > 1:
        kern.attention_combine_kernel[(B, H)](*parts, out, spans, H=H, D=D)
    return out


def silu_mul_triton(gate_up):
    """silu_mul as one Triton kernel; gate_up rows contiguous."""
    kern = triton_kernels()
    N, width = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    out = gate_up.new_empty(N, width)
    kern.silu_mul_kernel[(N, -(-width // SILU_BLOCK))](gate_up, out, width, gate_up.stride(0),
                                                       BLOCK=SILU_BLOCK)
    return out


failed_kernels = set()  # Triton kernels that failed at their first use: their composites run
checked_kernels = set()  # Triton kernels whose first output matched their composite's


def rope_store_reference(qkv, cos, sin, q_norm, k_norm, eps, n_heads, keys_t, values, rows,
                         column):
    """What qk_rope_store_composite returns and stores, computed aside (qkv cloned, a one-column
    copy a token): (q, each token's stored keys, its stored values) and the same read back from
    the real copy, for the first-use check."""
    N, Hkv, D = qkv.shape[0], keys_t.shape[1], keys_t.shape[2]
    keys, vals = keys_t.new_empty(N, Hkv, D, 1), values.new_empty(N, Hkv, 1, D)
    at, zero = torch.arange(N, device=qkv.device), torch.zeros_like(column)
    q = qk_rope_store_composite(qkv.clone(), cos, sin, q_norm, k_norm, eps, n_heads, keys, vals,
                                at, zero)
    return (q, keys[..., 0], vals[:, :, 0]), (keys_t[rows, :, :, column], values[rows, :, column])


def differences(name, out, composite, args):
    """A Triton kernel's output on `args` against its composite's on the same inputs: {what:
    (largest |difference|, 1 + largest |composite value|)}, over the entries the composite
    leaves finite (inert padded rows read memory never written). qk_rope_store's composite runs
    aside (rope_store_reference): its q and the keys and values each token stored."""
    if name == "qk_rope_store":
        (q, keys, vals), stored = rope_store_reference(*args)
        pairs = dict(qk_rope_store=(out, q), keys=(stored[0], keys), values=(stored[1], vals))
    else:
        pairs = {name: (out, composite(*args))}
    found = {}
    for what, (got, want) in pairs.items():
        got, want = got.float(), want.float()
        seen = torch.isfinite(want)
        if not seen.any():
            found[what] = (0.0, 1.0)
            continue
        found[what] = ((got[seen] - want[seen]).abs().max().item(),
                       1 + want[seen].abs().max().item())
    return found


def first_use_mismatch(name, out, composite, args):
    """Where a Triton kernel's first output leaves its composite's by more than rounding
    (FIRST_USE_TOLERANCE of the largest value; the largest difference, in words), else None.
    Skipped while a CUDA graph is captured."""
    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    tolerance = FIRST_USE_TOLERANCE.get(out.dtype, FIRST_USE_TOLERANCE[torch.float32])
    for worst, scale in differences(name, out, composite, args).values():
        if not worst <= tolerance * scale:
            return f"differs from its composite by {worst:.3g} (tolerance {tolerance * scale:.3g})"
    return None


def triton_or_composite(name, triton_fn, composite, *args):
    """triton_fn(*args) where Triton is importable and this kernel has not failed before, else
    composite(*args). At its first use a kernel's output is checked against its composite
    (first_use_mismatch); a first failure or mismatch prints one warning line and falls back for
    good."""
    if name not in failed_kernels and triton_kernels() is not None:
        try:
            out = triton_fn(*args)
            if name not in checked_kernels:
                if mismatch := first_use_mismatch(name, out, composite, args):
                    raise ArithmeticError(mismatch)
                checked_kernels.add(name)
            return out
        except Exception as error:  # a compile error of any kind: the run goes on, slower
            failed_kernels.add(name)
            print(f"warning: lab.kernels: the Triton {name} failed ({type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}); its composite runs "
                  "instead", file=sys.stderr)
    return composite(*args)


# -----------------------------------------------------------------------------
# the custom ops: the composite by default (a CPU), the Triton kernel on CUDA

OPS = (  # name, schema, composite, Triton launcher; qk_rope_store's qkv is scratch (the
    # composite rotates its q/k part in place, the kernel leaves it), keys_t and values written
    ("qk_rope_store", "(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, "
     "float eps, int n_heads, Tensor(b!) keys_t, Tensor(c!) values, Tensor rows, Tensor column) "
     "-> Tensor", qk_rope_store_composite, qk_rope_store_triton),
    ("decode_attention", "(Tensor q, Tensor keys_t, Tensor values, Tensor key_bias) -> Tensor",
     decode_attention, decode_attention_triton),
    ("silu_mul", "(Tensor gate_up) -> Tensor", layers.silu_mul, silu_mul_triton))


def define_ops(library):
    """Each of OPS as an operator of `library`: the composite for every device, and on CUDA the
    Triton kernel (triton_or_composite). Not torch.library.custom_op: its Python wrapper (which
    checks a mutating op's arguments each call) cost more on a CPU decode step than some of the
    composites themselves; an operator defined here counts and dispatches the same, its
    mutations declared in the schema (DECISIONS.md, Decode fusion)."""
    for name, schema, composite, triton_fn in OPS:
        library.define(name + schema)
        library.impl(name, composite, "CompositeExplicitAutograd")
        library.impl(name, functools.partial(triton_or_composite, name, triton_fn, composite),
                     "CUDA")
    return library


OPS_BY_NAME = {name: composite for name, _, composite, _ in OPS}
library = define_ops(torch.library.Library("persuarena", "DEF"))  # kept: the ops live while it does


def max_differences(device, dtype=torch.bfloat16, seed=0):
    """Each Triton kernel's largest |difference| from its composite on `device` at a paper-like
    decode shape (8 rows, 32 query heads on 8 kv heads of 128, 1000 keys of 1024 visible, Qwen3
    norms), for lab.bench --gpu-check; None where Triton does not run there (no Triton, or a CPU
    without its interpreter), {"error": ...} where a kernel fails."""
    on_cpu = torch.device(device).type != "cuda"
    if triton_kernels() is None or (on_cpu and os.environ.get("TRITON_INTERPRET") != "1"):
        return None
    try:
        return kernel_differences(device, dtype, seed)
    except Exception as error:  # the GPU check goes on and reports it
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}


def kernel_differences(device, dtype, seed):
    """max_differences's figures: each kernel and its composite on the same random inputs
    (differences)."""
    g = torch.Generator(device).manual_seed(seed)
    new = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)
    B, H, Hkv, D, C = 8, 32, 8, 128, 1024
    rope = (new(B, (H + 2 * Hkv) * D), new(B, 1, D), new(B, 1, D), new(D), new(D), 1e-6, H,
            new(B, Hkv, D, C), new(B, Hkv, C, D), torch.arange(B, device=device),
            torch.randint(0, C, (B,), generator=g, device=device))
    bias = torch.zeros(B * Hkv, 1, C, device=device)
    bias[:, :, 1000:] = -math.inf
    attention = (new(B, H, D), rope[7], rope[8], bias)
    gate_up = (new(B, 2 * 4096),)
    found = {}
    for name, triton_fn, args in (("qk_rope_store", qk_rope_store_triton, rope),
                                  ("decode_attention", decode_attention_triton, attention),
                                  ("silu_mul", silu_mul_triton, gate_up)):
        found |= differences(name, triton_fn(*args), OPS_BY_NAME[name], args)
    return {what: worst for what, (worst, _) in found.items()}
