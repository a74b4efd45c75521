"""The decoder's tensor functions (layers.py) against independent references: Hugging Face's own
forward; the fused weights as the parameters' only storage."""
import torch
import torch.nn.functional as F

from persuarena import layers
from conftest import tiny_model


@torch.no_grad()
def test_the_decoder_on_a_plain_causal_attention_is_hugging_faces_forward():
    """layers.decoder and lm_logits over fused (and, on a CPU, packed) weights, given plain causal
    SDPA as its attention, give the logits of the model's own forward, for each family."""
    for arch in ("llama", "qwen2", "qwen3"):
        model = tiny_model(arch)
        ids = torch.tensor([5, 17, 42, 9, 33, 8, 101, 7])
        reference = model(ids[None]).logits[0]
        w = layers.fused_weights(model)
        attend = lambda i, q, kv: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        logits = layers.lm_logits(w, layers.decoder(w, ids, torch.arange(len(ids)), attend))
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_fused_weights_are_the_parameters_storage():
    """A write into a parameter is a write into the fused tensor, and fusing again gives the
    same tensor at the same address (a weight refresh moves nothing)."""
    model = tiny_model("llama")
    a = model.model.layers[0].self_attn
    fused = layers.fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    with torch.no_grad():
        a.k_proj.weight[0, 0] = 123.0
    assert fused[a.q_proj.weight.shape[0], 0] == 123.0
    again = layers.fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    assert again.data_ptr() == fused.data_ptr() and torch.equal(again, fused)


def test_rotate_turns_each_pair_as_rotate_half_does_in_place():
    """layers.rotate equals the rotate-half formula written out pair by pair: (x1 cos - x2 sin,
    x2 cos + x1 sin) for the halves x1, x2 of each head, with attention scaling, written into
    `out` when given (x itself, as the decoder turns q and k inside the q/k/v output)."""
    torch.manual_seed(0)
    D, positions = 8, torch.tensor([0, 3, 17, 1000])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    w = dict(inv_freq=inv_freq, rope_scale=0.5)
    x = torch.randn(len(positions), 3, D, dtype=torch.float64)
    angle = (positions[:, None].float() * inv_freq[None]).double()  # float32 angles, as layers.rope
    cos, sin = (angle.cos() * 0.5)[:, None], (angle.sin() * 0.5)[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    expected = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    cos_sin = layers.rope(w, positions, torch.float64)
    torch.testing.assert_close(layers.rotate(x, *cos_sin), expected, atol=1e-5, rtol=0)
    out = layers.rotate(x, *cos_sin, out=x)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=0)


def test_a_residual_product_adds_into_the_residual_stream():
    """linear(x, W, residual=r) is r + x W^T, written into r itself."""
    torch.manual_seed(0)
    x, weight, residual = torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 5)
    expected = residual + x @ weight.T
    out = layers.linear(x, weight, residual=residual)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out, expected)
