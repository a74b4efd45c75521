"""
layers.py: the decoder's forward as plain tensor functions over fused weights (no cache, no
batching policy: engine.py owns those and passes the attention in).

    x_{l+1} = x_l + W_o Attn(RoPE(W_qkv RMSNorm(x_l)))
    x_{l+2} = x_{l+1} + W_down (silu(W_gate h) * W_up h),  h = RMSNorm(x_{l+1})
    logits  = W_lm RMSNorm(x_L)

A decode layer is few kernels (BENCHMARKS.md, kernels): the residual adds ride in the products
(addmm into x), the rotated keys land beside the values in the q/k/v output so
that attention stores both with one write.

Written against the Hugging Face weights of Llama, Qwen2 and Qwen3 (Qwen2's q/k/v biases, Qwen3's
per-head q/k norms). q/k/v and gate/up are fused into tensors that become the parameters' own
storage (fuse), so nothing is held twice and a weight refresh is a write at the same addresses.
Tested against Hugging Face's own forward (tests/test_layers.py) and through the engine, token for
token against Hugging Face `generate` (tests/test_engine.py).
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# not cuDNN, which recent PyTorch prefers on Hopper: it builds a graph per new shape, and every
# forward here has a new one (the batch, its queries and its block-rounded keys all vary)


def linear(x, weight, bias=None, residual=None):
    """x W^T + b, added in place into `residual` when given (the residual stream: one addmm,
    no separate add). A weight may instead be a callable taking (x, bias): lab.fastpath's
    prepacked CPU weights."""
    if callable(weight):
        out = weight(x, bias)
        return out if residual is None else residual.add_(out)
    if residual is None:
        return F.linear(x, weight, bias)
    assert bias is None, "layers.linear: a residual product takes no bias"
    return residual.addmm_(x, weight.t())


def fuse(params):
    """One tensor holding these parameters (matrices or bias vectors) one after another, which
    becomes their storage: each parameter is re-pointed at its slice, so the fused copy is the
    only copy (no byte held twice) and a write into the parameters (train.copy_weights, an
    optimizer step) is a write into the tensor the engine reads. Parameters already lying back
    to back in one storage (a model fused before) give that same tensor again, same address."""
    parts = [p.detach() for p in params]
    first, rows = parts[0], sum(p.shape[0] for p in parts)
    offsets = [p.storage_offset() for p in parts]
    if all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           for p in parts) and all(b == a + p.numel() for a, b, p in zip(offsets, offsets[1:], parts)):
        return first.as_strided((rows, *first.shape[1:]), first.stride(), offsets[0])
    fused = torch.cat(parts)
    for p, piece in zip(params, fused.split([p.shape[0] for p in parts])):
        p.data = piece
    return fused


def fused_weights(model):
    """The decoder's weights, with q/k/v and gate/up fused so a layer is four matrix products.
    The fused tensors are the model's own storage (fuse); every other entry is a parameter
    itself (lab.cpu_products.pack_weights may give a CPU's products a layout of their own)."""
    m, cfg = model.model, model.config
    layers = []
    with torch.no_grad():
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            w = dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv=fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                o=a.o_proj.weight, gate_up=fuse([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=mlp.down_proj.weight)
            if a.q_proj.bias is not None:  # Qwen2
                w["qkv_bias"] = fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            if hasattr(a, "q_norm"):  # Qwen3 normalises each head's q and k
                w["q_norm"], w["k_norm"] = a.q_norm.weight, a.k_norm.weight
            layers.append({k: v.detach() for k, v in w.items()})
    rope = m.rotary_emb
    return dict(
        layers=layers, embed=m.embed_tokens.weight.detach(), norm=m.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(), inv_freq=rope.inv_freq.detach().float(),
        rope_scale=float(getattr(rope, "attention_scaling", 1.0)), eps=cfg.rms_norm_eps,
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        max_len=cfg.max_position_embeddings)


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, accumulated in float32 (PyTorch's
    own op: one fused kernel on a GPU where a hand-written one launches eight)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rotate(x, cos, signed_sin, out=None):
    """RoPE on [N, heads, head_dim], rotate-half convention: x cos + (-x2, x1) sin, written as
    x cos + roll(x) (-sin, sin), with cos and signed_sin [N, 1, head_dim], into `out` when given
    (the q/k/v output itself: the rotated keys then lie beside the values). Neither one addcmul
    nor a product with a rotation matrix a position: a fused multiply-add rounds differently in
    a vector body and its scalar tail, and a batched product's rounding moved with the batch, so
    an episode's numbers would depend on its batch neighbours (DECISIONS.md: Keyed random
    streams, Decode fusion)."""
    return torch.add(x * cos, x.roll(x.shape[-1] // 2, -1) * signed_sin, out=out)


def rope(w, positions, dtype):
    """cos and signed sin [N, 1, head_dim] of each token's position (rotate-half RoPE)."""
    freqs = positions[:, None].float() * w["inv_freq"][None]
    emb = torch.cat([freqs, freqs], -1)
    cos = (emb.cos() * w["rope_scale"]).to(dtype)[:, None]
    sin = (emb.sin() * w["rope_scale"]).to(dtype)[:, None]
    sin[..., :sin.shape[-1] // 2] *= -1
    return cos, sin


def turn_qk(qkv, cos, sin, q_norm, k_norm, eps, n_heads, head_dim):
    """Queries [N, H, D] and kv [N, 2, kv_heads, D] (rotated keys beside the values) of a q/k/v
    output: Qwen3's per-head norms of q and k when given (each head normalised, scaled by its
    weight), then RoPE of q and k together, written in place into qkv (views of it come back)."""
    N, H, D = qkv.shape[0], n_heads, head_dim
    Hkv = (qkv.shape[1] // D - H) // 2
    qk = qkv[:, :(H + Hkv) * D].view(N, H + Hkv, D)
    turned = qk
    if q_norm is not None:
        turned = torch.cat([F.rms_norm(qk[:, :H], (D,), q_norm, eps),
                            F.rms_norm(qk[:, H:], (D,), k_norm, eps)], 1)
    rotate(turned, cos, sin, out=qk)  # queries and keys in one go, in place
    return qk[:, :H], qkv[:, H * D:].view(N, 2, Hkv, D)


def silu_mul(gate_up):
    """silu(gate) * up of the fused gate/up product's output [N, 2 * intermediate]."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate).mul_(up)


def decoder(w, ids, positions, attend, backends=None, fused=None):
    """Final hidden states [N, hidden] of a packed batch of tokens; attend(layer, q, kv) is the
    attention path (q [N, H, D], kv [N, 2, kv_heads, D] the rotated keys and the
    values side by side), which also stores k and v wherever the path keeps them; its SDPA calls
    may use `backends` (default SDPA_BACKENDS). `fused` (lab.fastpath's decode step: lab.kernels)
    replaces two pieces with fused ones: fused.rope_store(layer, qkv, cos, sin) does turn_qk and
    stores k and v itself, returning q (attend then gets kv None), and fused.silu_mul(gate_up)."""
    x = w["embed"][ids]
    cos, sin = rope(w, positions, x.dtype)
    N, H, D = len(ids), w["n_heads"], w["head_dim"]
    with sdpa_kernel(SDPA_BACKENDS if backends is None else backends):
        for i, lw in enumerate(w["layers"]):
            qkv = linear(rms_norm(x, lw["ln1"], w["eps"]), lw["qkv"], lw.get("qkv_bias"))
            if fused is None:
                q, kv = turn_qk(qkv, cos, sin, lw.get("q_norm"), lw.get("k_norm"), w["eps"], H, D)
            else:
                q, kv = fused.rope_store(i, qkv, cos, sin), None
            x = linear(attend(i, q, kv).reshape(N, H * D), lw["o"], residual=x)
            gate_up = linear(rms_norm(x, lw["ln2"], w["eps"]), lw["gate_up"])
            x = linear((silu_mul if fused is None else fused.silu_mul)(gate_up), lw["down"],
                       residual=x)
    return x


def lm_logits(w, x):
    return linear(rms_norm(x, w["norm"], w["eps"]), w["lm_head"])
