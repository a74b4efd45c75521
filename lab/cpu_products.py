"""
lab/cpu_products.py: the engine's matrix products on a CPU. oneDNN multiplies a few rows (a
decode step) ~1.7x faster than MKL when the weight is prepacked into a layout of its own, so
the fast path (lab/fastpath.py) hands layers.linear a Packed weight in place of the tensor:

    y = x W^T + b     W reordered once by oneDNN (_reorder_linear_weight), x and y as they were

in float32 on any CPU, and in bf16 only where oneDNN's bf16 kernels run (AVX512-BW/VL/DQ or
AVX-NE-CONVERT: onednn_bf16). Elsewhere, an AVX2 CPU without them, oneDNN refuses a bf16
weight, and the bf16 products stay PyTorch's own (correct, and several times slower than
float32 there: the machine's default dtype is then float32, lab.presets.cpu_dtype).

    python -m pytest -q tests/test_cpu_products.py
"""
import functools

import torch

PACK_CPU_WEIGHTS = True   # oneDNN-prepacked weights on a CPU: decode products ~1.7x MKL's here
PACKED_DTYPES = (torch.float32, torch.bfloat16)  # ... in these dtypes (bf16: oneDNN's bf16 kernels,
# where this CPU runs them: onednn_bf16)
PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products (layers.fused_weights' names)


@functools.cache
def onednn_bf16():
    """Whether oneDNN runs bf16 products on this CPU (its own check: AVX512-BW/VL/DQ or
    AVX-NE-CONVERT); without them it refuses to pack a bf16 weight."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


def packs(device, dtype):
    """Whether pack_weights packs weights of this dtype on this device (PACK_CPU_WEIGHTS,
    PACKED_DTYPES, oneDNN present, and for bf16 its bf16 kernels on this CPU)."""
    return (PACK_CPU_WEIGHTS and torch.device(device).type == "cpu" and dtype in PACKED_DTYPES
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (dtype != torch.bfloat16 or onednn_bf16()))


def pack_weights(w):
    """The engine's weights with each matrix product's weight oneDNN-prepacked on a CPU (a
    copy in a layout of its own, where packs), else w itself. layers.linear calls a packed
    weight (Packed) in place of F.linear."""
    if not packs(w["embed"].device, w["embed"].dtype):
        return w
    return {**w, "lm_head": Packed(w["lm_head"]),
            "layers": [{k: Packed(v) if k in PRODUCTS else v for k, v in lw.items()}
                       for lw in w["layers"]]}


class Packed:
    """A weight in oneDNN's prepacked layout, for CPU matrix products of a few rows (decode);
    called as layers.linear would call F.linear. A single row is multiplied as two (itself
    twice): oneDNN's one-row kernel rounds a row unlike the same row among others once the inner
    dimension passes ~1k (SmolLM2's down projection), so a sequence decoding alone would round
    unlike itself in a batch; from two rows on the rows agree (DECISIONS.md: Decode fusion)."""

    def __init__(self, weight):
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight, 8)

    def __call__(self, x, bias=None):
        if x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.data,
                                                      bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
