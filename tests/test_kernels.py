"""lab.kernels: the custom ops on a CPU are the plain composites bit for bit (and so is a decoder
with them, and an engine's decode), and, where Triton is importable and TRITON_INTERPRET=1, each
Triton kernel (run by the interpreter on CPU tensors) is within a rounding of its composite and
the Triton attention gives a row the same bits alone and beside a longer row; where Triton is
importable, its compiler takes every kernel to an H200's machine code without register spills.

    python -m pytest -q tests/test_kernels.py
    TRITON_INTERPRET=1 PYTHONPATH=<triton 3.6> python -m pytest -q tests/test_kernels.py
"""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from persuarena import engine
from persuarena import layers
from conftest import tiny_model
from lab import kernels

SHAPES = {  # (query heads, kv heads, head_dim, per-head q/k norms)
    "llama": (4, 2, 16, False), "qwen3": (4, 2, 16, True), "gqa-3": (6, 2, 32, True),
    "mha": (2, 2, 8, False)}


def interpreted():
    """Whether the Triton kernels run here: triton importable and its interpreter switched on."""
    return os.environ.get("TRITON_INTERPRET") == "1" and kernels.triton_kernels() is not None


needs_triton = pytest.mark.skipif(
    not interpreted(), reason="Triton kernels: needs triton importable and TRITON_INTERPRET=1")


def case(shape, dtype, rows=3, columns=40, seed=0):
    """Random inputs of one decode step: q/k/v output, RoPE, norms, the dense copy, its columns."""
    H, Hkv, D, norm = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    new = lambda *s: torch.randn(*s, generator=g).to(dtype)
    angles = torch.rand(rows, 1, D // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)  # signed_sin: (-sin, sin), layers.rope
    return SimpleNamespace(
        H=H, Hkv=Hkv, D=D, qkv=new(rows, (H + 2 * Hkv) * D), cos=cos, plain_sin=sin,
        sin=torch.cat([-sin[..., :D // 2], sin[..., D // 2:]], -1),
        norms=(new(D), new(D)) if norm else (None, None), keys_t=new(rows, Hkv, D, columns),
        values=new(rows, Hkv, columns, D), rows=torch.arange(rows),
        column=torch.randint(0, columns, (rows,), generator=g), q=new(rows, H, D))


def rope_store(fn, c):
    """fn (an op, composite or Triton) on copies of the case's tensors: q, keys_t, values."""
    keys_t, values = c.keys_t.clone(), c.values.clone()
    q = fn(c.qkv.clone(), c.cos, c.sin, *c.norms, 1e-6, c.H, keys_t, values, c.rows, c.column)
    return q, keys_t, values


def bias_for(lengths, Hkv, columns):
    """The decode step's float32 bias [B * kv_heads, 1, columns]: -inf past each row's keys."""
    hidden = torch.arange(columns) >= torch.tensor(lengths)[:, None, None]
    bias = torch.zeros(hidden.shape).masked_fill_(hidden, -math.inf)
    return bias.repeat_interleave(Hkv, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["llama", "qwen3", "gqa-3"])
def test_each_custom_op_on_a_cpu_is_its_composite_bit_for_bit(shape, dtype):
    """The ops' CPU implementations against the pieces written out here: Qwen3's norms as
    F.rms_norm per head, RoPE as rotate-half, k and v stored at (row, column) by a loop."""
    c = case(shape, dtype)
    q, keys_t, values = rope_store(torch.ops.persuarena.qk_rope_store, c)
    N, H, Hkv, D = len(c.qkv), c.H, c.Hkv, c.D
    x = c.qkv.view(N, -1, D)[:, :H + Hkv]
    if c.norms[0] is not None:
        x = torch.cat([F.rms_norm(x[:, :H], (D,), c.norms[0], 1e-6),
                       F.rms_norm(x[:, H:], (D,), c.norms[1], 1e-6)], 1)
    half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    turned = x * c.cos + half * c.plain_sin
    assert torch.equal(q, turned[:, :H]) and q.is_contiguous()
    expect_k, expect_v = c.keys_t.clone(), c.values.clone()
    for n in range(N):
        expect_k[n, :, :, c.column[n]] = turned[n, H:]
        expect_v[n, :, c.column[n]] = c.qkv.view(N, -1, D)[n, H + Hkv:]
    assert torch.equal(keys_t, expect_k) and torch.equal(values, expect_v)
    bias = bias_for([5, 40, 17], Hkv, 40)
    assert torch.equal(torch.ops.persuarena.decode_attention(c.q, keys_t, values, bias),
                       kernels.decode_attention(c.q, keys_t, values, bias))
    gate_up = c.qkv[:, :4 * D]
    assert torch.equal(torch.ops.persuarena.silu_mul(gate_up),
                       F.silu(gate_up[:, :2 * D]) * gate_up[:, 2 * D:])


def decode_step(arch, hooks, dtype=torch.float32, seed=0):
    """One decode step of 3 rows through layers.decoder over a dense copy of random past keys
    (rows of 5, 23 and 31 keys before this token), with `hooks` (decode_ops-like, or None: the
    plain decoder with its attend storing kv): final hidden states, keys and values copies."""
    w = layers.fused_weights(tiny_model(arch).to(dtype))
    L, H, Hkv, D = len(w["layers"]), w["n_heads"], w["n_kv_heads"], w["head_dim"]
    g = torch.Generator().manual_seed(seed)
    keys_t = torch.randn(L, 3, Hkv, D, 48, generator=g).to(dtype)
    values = torch.randn(L, 3, Hkv, 48, D, generator=g).to(dtype)
    positions, rows = torch.tensor([5, 23, 31]), torch.arange(3)
    bias = bias_for((positions + 1).tolist(), Hkv, 40)
    attention = kernels.decode_attention if hooks is None else hooks.decode_attention

    def attend(layer, q, kv):
        if kv is not None:
            keys_t[layer][rows, :, :, positions] = kv[:, 0]
            values[layer][rows, :, positions] = kv[:, 1]
        return attention(q, keys_t[layer][..., :40], values[layer][:, :, :40], bias)

    fused = None if hooks is None else SimpleNamespace(
        silu_mul=hooks.silu_mul, rope_store=lambda i, qkv, cos, sin: hooks.qk_rope_store(
            qkv, cos, sin, w["layers"][i].get("q_norm"), w["layers"][i].get("k_norm"), w["eps"],
            H, keys_t[i], values[i], rows, positions))
    x = layers.decoder(w, torch.tensor([11, 12, 13]), positions, attend, fused=fused)
    return x, keys_t, values


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_decoder_with_the_fused_ops_is_the_plain_decoder_bit_for_bit(arch):
    plain = decode_step(arch, None)
    for fused in (kernels.decode_ops(True), kernels.decode_ops(False)):
        for a, b in zip(decode_step(arch, fused), plain):
            assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_engine_decodes_the_same_bits_with_and_without_the_custom_ops(arch):
    """generate on the fast path (DecodeBatch), custom ops on against off: tokens and log-probs
    equal, so the switch (lab.fastpath.FUSED_KERNELS) changes nothing on a CPU."""
    eng = engine.Engine(tiny_model(arch), None)
    results = []
    for fused in (True, False):
        eng.fast.fused_kernels = fused
        sids = [eng.new(list(range(3, 3 + n))) for n in (9, 30)]
        results.append(eng.generate(sids, 6, stop_ids=[])[0])
        for s in sids:
            eng.free(s)
    assert results[0] == results[1]


# -----------------------------------------------------------------------------
# the Triton kernels (Triton's interpreter on CPU tensors)


def gpu_composite(q, keys_t, values, bias):
    """The composite decode attention as it runs on a GPU (float32 scores whatever the dtype):
    what the Triton kernels compute; on a CPU the bf16 composite rounds its scores to bf16."""
    return kernels.decode_attention(q, keys_t, values, bias, float32_scores=True)


def assert_within_rounding(actual, expected, dtype):
    """fp32: a few float32 roundings; bf16: at most one bfloat16 rounding step apart."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=2 ** -9)


def assert_attention_within_rounding(actual, q, keys_t, values, bias, dtype):
    """The Triton attention against gpu_composite's, a rounding apart measured against the scale
    of the terms summed, sum_j p_j |v_j| (the composite over |values|), not of their sum: where
    the terms cancel, a bf16 rounding of each p_j moves the output by up to 2^-8 of that scale,
    however small the output (so a relative tolerance on the output alone fails by chance)."""
    expected = gpu_composite(q, keys_t, values, bias)
    if dtype == torch.float32:
        return assert_within_rounding(actual, expected, dtype)
    scale = gpu_composite(q, keys_t, values.abs(), bias).float()
    excess = (actual.float() - expected.float()).abs() - (2 ** -7 * scale + 2 ** -9)
    where = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    assert excess.max() <= 0, f"{excess.max():.3g} past a rounding at {where}"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_triton_kernel_is_within_a_rounding_of_its_composite(shape, dtype):
    c = case(shape, dtype)
    fused, plain = (rope_store(f, c) for f in (kernels.qk_rope_store_triton,
                                               kernels.qk_rope_store_composite))
    for a, b in zip(fused, plain):
        assert_within_rounding(a, b, dtype)
    assert torch.equal(fused[2], plain[2])  # the values are copied, not computed
    if c.norms[0] is None:  # RoPE alone: the same two roundings as the composite's
        assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    for lengths in ([5, 40, 17], [1, 1, 1], [33, 64, 65]):  # a chunk's edge, a row of one key
        columns = 80
        g = torch.Generator().manual_seed(sum(lengths))  # the same inputs whatever ran before
        keys_t, values = (torch.randn(3, c.Hkv, *s, generator=g).to(dtype)
                          for s in ((c.D, columns), (columns, c.D)))
        bias = bias_for(lengths, c.Hkv, columns)
        assert_attention_within_rounding(kernels.decode_attention_triton(c.q, keys_t, values, bias),
                                         c.q, keys_t, values, bias, dtype)
    # two programs a row, the second masked
    gate_up = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(dtype)
    fused, plain = kernels.silu_mul_triton(gate_up), layers.silu_mul(gate_up)
    assert_within_rounding(fused, plain, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_triton_attention_is_within_a_rounding_of_its_composite(dtype, monkeypatch):
    """Flash-decoding: contexts spread over spans of 64 keys (up to 5 programs a row and head,
    then the combine), rows ending inside, at and just past a span's edge, a row of one key,
    GQA: within a rounding of the composite; and each row alone, at its own extent, gives the
    same bits as in the batch."""
    monkeypatch.setattr(kernels, "ATTENTION_SPAN", 64)
    H, Hkv, D = 6, 2, 32
    g = torch.Generator().manual_seed(5)
    new = lambda *s: torch.randn(*s, generator=g).to(dtype)
    lengths = [300, 64, 65, 1, 129, 200]
    q, keys_t, values = new(6, H, D), new(6, Hkv, D, 320), new(6, Hkv, 320, D)
    for row, n in enumerate(lengths):  # the decode copy holds zeros past a row's keys
        keys_t[row, ..., n:], values[row, :, n:] = 0, 0
    bias = bias_for(lengths, Hkv, 320)
    batch = kernels.decode_attention_triton(q, keys_t, values, bias)
    assert_attention_within_rounding(batch, q, keys_t, values, bias, dtype)
    for row, n in enumerate(lengths):
        extent = -(-n // 16) * 16
        alone = kernels.decode_attention_triton(
            q[row:row + 1], keys_t[row:row + 1, ..., :extent].contiguous(),
            values[row:row + 1, :, :extent].contiguous(), bias_for([n], Hkv, extent))
        assert torch.equal(alone[0], batch[row]), (row, n)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_attention_gives_a_row_its_bits_alone_and_beside_a_longer_row(dtype):
    """A row of 100 keys (four chunks) alone (its extent 112: one span, no combine) and beside a
    row of 300 (the extent 320: two spans and the combine, its own columns past 100 holding zeros
    as the decode copy's do): the same output bits."""
    H, Hkv, D = 4, 2, 16
    g = torch.Generator().manual_seed(3)
    new = lambda *s: torch.randn(*s, generator=g).to(dtype)
    q, keys_t, values = new(2, H, D), new(2, Hkv, D, 320), new(2, Hkv, 320, D)
    keys_t[0, ..., 100:], values[0, :, 100:] = 0, 0
    alone = kernels.decode_attention_triton(q[:1], keys_t[:1, ..., :112], values[:1, :, :112],
                                            bias_for([100], Hkv, 112))
    beside = kernels.decode_attention_triton(q, keys_t, values, bias_for([100, 300], Hkv, 320))
    assert torch.equal(alone[0], beside[0])
    assert_attention_within_rounding(beside, q, keys_t, values, bias_for([100, 300], Hkv, 320), dtype)


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_decoder_on_the_triton_kernels_is_within_roundings_of_the_plain_one(arch):
    """The kernels wired as the decode step wires them (views of a layer's copy, its strides):
    one step's hidden states and stored keys and values close to the plain decoder's (the first
    layer's values equal: they are the q/k/v product's, before any kernel)."""
    triton_ops = SimpleNamespace(qk_rope_store=kernels.qk_rope_store_triton,
                                 decode_attention=kernels.decode_attention_triton,
                                 silu_mul=kernels.silu_mul_triton)
    (x, keys_t, values), plain = decode_step(arch, triton_ops), decode_step(arch, None)
    torch.testing.assert_close(x, plain[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(keys_t, plain[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values, plain[2], rtol=1e-5, atol=1e-6)
    assert torch.equal(values[0], plain[2][0])


def test_a_kernel_that_fails_at_first_use_warns_once_and_the_composite_runs(monkeypatch, capsys):
    """triton_or_composite (the CUDA implementations' dispatch): a Triton launch that raises
    (a compile error) gives one warning line and the composite's result, then the composite
    alone for the process's life (the launcher is not tried again)."""
    tries = []

    def failing(gate_up):
        tries.append(1)
        raise RuntimeError("PTX compile failed\nsecond line of the report")

    monkeypatch.setattr(kernels, "triton_kernels", lambda: SimpleNamespace())
    monkeypatch.setattr(kernels, "failed_kernels", set())
    gate_up = torch.randn(3, 8)
    for _ in range(2):
        out = kernels.triton_or_composite("silu_mul", failing, layers.silu_mul, gate_up)
        assert torch.equal(out, layers.silu_mul(gate_up))
    err = capsys.readouterr().err
    assert len(tries) == 1 and err.count("\n") == 1, err
    assert "silu_mul" in err and "PTX compile failed" in err and "second line" not in err
    assert interpreted() or kernels.max_differences("cpu") is None  # no Triton run on a CPU


def first_use(name, triton_fn, c, monkeypatch, capsys):
    """triton_or_composite of one op at its first use, with triton_fn as the kernel: (its output,
    the warning printed, whether the kernel is now marked failed)."""
    monkeypatch.setattr(kernels, "triton_kernels", lambda: SimpleNamespace())
    monkeypatch.setattr(kernels, "failed_kernels", set())
    monkeypatch.setattr(kernels, "checked_kernels", set())
    composite = kernels.OPS_BY_NAME[name]
    if name == "qk_rope_store":
        keys_t, values = c.keys_t.clone(), c.values.clone()
        out = kernels.triton_or_composite(name, triton_fn, composite, c.qkv.clone(), c.cos, c.sin,
                                          *c.norms, 1e-6, c.H, keys_t, values, c.rows, c.column)
        out = (out, keys_t, values)
    else:
        out = kernels.triton_or_composite(name, triton_fn, composite, c.q)
    return out, capsys.readouterr().err, name in kernels.failed_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_whose_first_output_is_not_its_composites_warns_and_falls_back(
        dtype, monkeypatch, capsys):
    """At its first use a kernel's output is checked against its composite (first_use_mismatch):
    a kernel off by a sign in one head (RoPE + store: in q, or only in the stored keys; silu_mul)
    warns in one line and the composite's result is used, for good; one off by rounding passes
    and its output is used."""
    c = case("qwen3", dtype)
    expected = rope_store(kernels.qk_rope_store_composite, c)

    def rope_kernel(flip_q=False, flip_keys=False, nudge=0.0):
        def kernel(qkv, *rest):
            q = kernels.qk_rope_store_composite(qkv.clone(), *rest)  # the kernel leaves qkv
            keys_t, rows, column = rest[6], rest[8], rest[9]
            if flip_q:
                q[:, 1] = -q[:, 1]
            if flip_keys:
                keys_t[rows[0], 1, :, column[0]] *= -1
            return q * (1 + nudge)
        return kernel
    for bad in (rope_kernel(flip_q=True), rope_kernel(flip_keys=True)):
        (q, keys_t, values), err, failed = first_use("qk_rope_store", bad, c, monkeypatch, capsys)
        assert failed and err.count("\n") == 1 and "differs from its composite" in err, err
        assert torch.equal(q, expected[0]) and torch.equal(keys_t, expected[1])
    near = rope_kernel(nudge=2 ** -12 if dtype == torch.float32 else 2 ** -6)
    (q, keys_t, _), err, failed = first_use("qk_rope_store", near, c, monkeypatch, capsys)
    assert not failed and err == "" and not torch.equal(q, expected[0])
    c.q = torch.randn(3, 2 * 64).to(dtype)  # silu_mul's input
    out, err, failed = first_use("silu_mul", lambda x: -layers.silu_mul(x), c, monkeypatch, capsys)
    assert failed and "silu_mul" in err and torch.equal(out, layers.silu_mul(c.q))


@needs_triton
@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_each_triton_kernel_passes_its_first_use_check(shape):
    """The real kernels (under the interpreter) are within first_use_mismatch's tolerance."""
    c = case(shape, torch.bfloat16)
    args = (c.qkv.clone(), c.cos, c.sin, *c.norms, 1e-6, c.H, c.keys_t.clone(), c.values.clone(),
            c.rows, c.column)
    out = kernels.qk_rope_store_triton(*args)
    assert kernels.first_use_mismatch("qk_rope_store", out, None, args) is None
    bias = bias_for([5, 40, 17], c.Hkv, c.keys_t.shape[3])
    attention = (c.q, c.keys_t, c.values, bias)
    assert kernels.first_use_mismatch("decode_attention", kernels.decode_attention_triton(
        *attention), kernels.decode_attention, attention) is None
    gate_up = torch.randn(3, 2 * 1100).to(torch.bfloat16)
    assert kernels.first_use_mismatch("silu_mul", kernels.silu_mul_triton(gate_up),
                                      layers.silu_mul, (gate_up,)) is None


COMPILE = """
import json, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lab import kernels, triton_kernels as k
ptxas = __import__("pathlib").Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
found = {}
for dt in ("bf16", "fp32"):
    p = lambda *names: {n: "*" + dt for n in names}
    i32 = lambda *names: {n: "i32" for n in names}
    const = lambda *names: {n: "constexpr" for n in names}
    rope = {**p("qkv", "cos", "sin", "q_norm", "k_norm", "q_out", "keys_t", "values"),
            "rows": "*i64", "column": "*i64", **i32("qkv_stride", "cos_stride"), "eps": "fp32",
            **i32("kt_row", "kt_head", "kt_dim", "kt_col", "v_row", "v_head", "v_col", "v_dim"),
            **const("H", "HKV", "D", "NORM")}
    f32 = lambda *names: {n: "*fp32" for n in names}
    attention = {**p("q", "keys_t", "values"), "bias": "*fp32", **p("out"),
                 **f32("part_max", "part_sum", "part_acc"), "K": "i32",
                 "scale": "fp32", **i32("kt_row", "kt_head", "kt_dim", "v_row", "v_head", "v_col",
                                        "bias_row"), **const("H", "G", "D", "BLOCK", "SPAN", "SPLIT")}
    combine = {**f32("part_max", "part_sum", "part_acc"), **p("out"), "spans": "i32",
               **const("H", "D")}
    silu = {**p("gate_up", "out"), **i32("width", "stride"), "BLOCK": "constexpr"}
    for name, fn, sig, consts in (
            ("rope", k.rope_store_kernel, rope, dict(H=32, HKV=8, D=128, NORM=True)),
            ("attention", k.attention_kernel, attention,
             dict(H=40, G=5, D=128, BLOCK=kernels.ATTENTION_BLOCK, SPAN=kernels.ATTENTION_SPAN,
                  SPLIT=True)),
            ("attention combine", k.attention_combine_kernel, combine, dict(H=40, D=128)),
            ("silu_mul", k.silu_mul_kernel, silu, dict(BLOCK=kernels.SILU_BLOCK))):
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(compiled.asm["ptx"])
            f.flush()
            report = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", f.name, "-o", "/dev/null"],
                                    capture_output=True, text=True, check=True).stderr
        found[name + " " + dt] = [line.split(":")[-1].strip() for line in report.splitlines()
                                  if "registers" in line or "spill" in line]
print(json.dumps(found))
"""


@pytest.mark.skipif(kernels.triton_kernels() is None, reason="needs triton importable")
def test_each_triton_kernel_compiles_for_an_h200_without_spilling():
    """Triton's own compiler (not its interpreter: a subprocess without TRITON_INTERPRET) takes
    every kernel to sm_90 machine code in bf16 and fp32, at Qwen3-14B's heads (GQA 5), and
    ptxas reports no register spills: the path a lent H200 runs, checked without one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path])
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert len(found) == 8, found
    for name, lines in found.items():
        assert any(line.startswith("0 bytes stack frame, 0 bytes spill stores") for line in lines), (
            name, lines)
