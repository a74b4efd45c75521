"""The decoder's tensor functions (layers.py) against independent references: Hugging Face's own
forward; the fused weights as the parameters' only storage."""
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
