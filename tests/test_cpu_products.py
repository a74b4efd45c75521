"""lab/cpu_products.py: oneDNN-prepacked weights on a CPU, in float32 everywhere and in bf16
only where oneDNN runs bf16 kernels; each product against a float64 reference, a row alone
against the same row among others, and an engine on a CPU without oneDNN's bf16 kernels
(AVX2 alone), whose bf16 weights stay PyTorch's tensors."""
import pytest
import torch

from persuarena import engine
from conftest import tiny_model
from lab import cpu_products

ONEDNN = (torch.backends.mkldnn.is_available()
          and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
DTYPES = [torch.float32,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              not cpu_products.onednn_bf16(), reason="oneDNN runs no bf16 products on this CPU"))]


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN weight packing in this PyTorch")
@pytest.mark.parametrize("out_features,in_features", [(576, 1536), (1536, 576), (128, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_product_gives_a_row_its_bits_alone_and_among_others(out_features, in_features,
                                                                     dtype):
    """A prepacked CPU product of one row equals that row inside products of 2 to 23 rows (a
    lone row took oneDNN's one-row kernel, which rounds differently past ~1k inputs: SmolLM2's
    down projection), and every row is the float64 product within the dtype's rounding."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(24, in_features, generator=g).to(dtype)
    packed = cpu_products.Packed(weight)
    full = packed(x)
    assert [m for m in range(1, 24) if not torch.equal(packed(x[:m]), full[:m])] == []
    assert torch.equal(packed(x[:1], bias := torch.randn(out_features, generator=g).to(dtype)),
                       packed(x, bias)[:1])
    exact = x.double() @ weight.double().t()
    # a sum of n products rounds by about eps * sqrt(n) * sum |x_i w_i| (float32 sums for bf16)
    scale = x.double().abs() @ weight.double().abs().t()
    bound = 4 * torch.finfo(dtype).eps * in_features ** 0.5 * scale
    assert bool(((full.double() - exact).abs() <= bound).all())


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN weight packing in this PyTorch")
def test_packs_float32_always_and_bf16_only_with_onednns_bf16_kernels(monkeypatch):
    """packs: float32 on a CPU whenever PACK_CPU_WEIGHTS; bf16 only where onednn_bf16 says so
    (oneDNN refuses a bf16 weight on an AVX2 CPU); never float16, never off the CPU."""
    for has_bf16 in (False, True):
        monkeypatch.setattr(cpu_products, "onednn_bf16", lambda: has_bf16)
        assert cpu_products.packs("cpu", torch.float32)
        assert cpu_products.packs("cpu", torch.bfloat16) == has_bf16
        assert not cpu_products.packs("cpu", torch.float16)
        assert not cpu_products.packs("meta", torch.float32)
    monkeypatch.setattr(cpu_products, "PACK_CPU_WEIGHTS", False)
    assert not cpu_products.packs("cpu", torch.float32)


def test_onednn_bf16_agrees_with_onednn_itself():
    """onednn_bf16 is True exactly where oneDNN packs a bf16 weight (here it either packs or
    raises, as it did on an AVX2 CPU before this check)."""
    weight = torch.randn(16, 32).bfloat16()
    if not ONEDNN:
        pytest.skip("no oneDNN weight packing in this PyTorch")
    try:
        cpu_products.Packed(weight)
        packed = True
    except RuntimeError:
        packed = False
    assert cpu_products.onednn_bf16() == packed


def test_a_bf16_engine_without_onednns_bf16_kernels_keeps_plain_weights(monkeypatch):
    """Where oneDNN has no bf16 kernels the engine's bf16 weights stay tensors (F.linear's
    products), and its logits equal those of an engine with packing off altogether; the same
    engine in float32 still packs."""
    monkeypatch.setattr(cpu_products, "onednn_bf16", lambda: False)
    model = tiny_model("qwen3").to(torch.bfloat16)
    prompt = [5, 9, 13, 2, 7, 11]
    eng = engine.Engine(model, block_size=4, num_blocks=64)
    assert all(isinstance(lw[k], torch.Tensor) for lw in eng.w["layers"]
               for k in cpu_products.PRODUCTS)
    logits = eng.forward([eng.new(prompt)])
    monkeypatch.setattr(cpu_products, "PACK_CPU_WEIGHTS", False)
    plain = engine.Engine(model, block_size=4, num_blocks=64)
    assert torch.equal(logits, plain.forward([plain.new(prompt)]))
    if ONEDNN:  # float32 packs on the same CPU, and its logits are the model's own
        monkeypatch.setattr(cpu_products, "PACK_CPU_WEIGHTS", True)
        f32_model = tiny_model("qwen3")
        f32 = engine.Engine(f32_model, block_size=4, num_blocks=64)
        assert isinstance(f32.w["layers"][0]["qkv"], cpu_products.Packed)
        hf = f32_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(f32.forward([f32.new(prompt)])[0], hf, atol=1e-4, rtol=0)
