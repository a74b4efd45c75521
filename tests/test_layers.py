"""The decoder's tensor functions (layers.py) against independent references: Hugging Face's own
forward, SDPA, float32 scores; the fused weights as the parameters' only storage."""
import torch
import torch.nn.functional as F

import layers
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
        attend = lambda i, q, k, v: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
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


def test_decode_attention_matches_sdpa():
    """The two-product grouped-query decode attention equals SDPA with a boolean key mask."""
    torch.manual_seed(0)
    B, H, Hkv, K, D = 3, 6, 2, 11, 8
    q, keys, values = torch.randn(B, H, D), torch.randn(B, Hkv, K, D), torch.randn(B, Hkv, K, D)
    visible = torch.arange(K) < torch.tensor([11, 4, 1])[:, None, None]  # [B, 1, K]
    bias = torch.zeros(B, 1, K).masked_fill(~visible, float("-inf")).repeat_interleave(Hkv, 0)
    ref = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible[:, None],
                                         enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(layers.decode_attention(q, keys.transpose(2, 3), values, bias), ref)


def test_decode_scores_are_float32_in_bfloat16():
    """bf16 queries and keys whose scores differ by less than bf16's spacing at their size:
    the attention equals the reference with float32 scores and softmax (then bf16
    probabilities, as flash-attn's), far closer than scores rounded to bf16 would give."""
    torch.manual_seed(0)
    B, H, Hkv, K, D = 2, 4, 2, 64, 16
    q = (torch.randn(B, H, D) * 4).bfloat16()
    keys, values = (torch.randn(B, Hkv, K, D) * 4).bfloat16(), torch.randn(B, Hkv, K, D).bfloat16()
    bias = torch.zeros(B * Hkv, 1, K)
    out = layers.decode_attention(q, keys.transpose(2, 3), values, bias).float()
    G = H // Hkv
    kq = keys.float().repeat_interleave(G, 1)
    scores = torch.einsum("bhd,bhkd->bhk", q.float(), kq) / D ** 0.5
    ref = torch.einsum("bhk,bhkd->bhd", scores.softmax(-1).bfloat16().float(),
                       values.float().repeat_interleave(G, 1))
    rounded = torch.einsum("bhk,bhkd->bhd", scores.bfloat16().float().softmax(-1),
                           values.float().repeat_interleave(G, 1))
    error, rounding = (out - ref).abs().max(), (rounded - ref).abs().max()
    assert error < 0.02 and error < rounding / 4, (error, rounding)

