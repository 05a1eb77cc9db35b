"""lathe.kernels: Triton kernels, each beside its PyTorch reference, and the dispatch
between them (see docs/design.md); native C++ kernels for CPU decoding, which Triton cannot
serve off-GPU (`cpu_native`, `decode_linear`, `argmax`, `lora_bgmv`). Each op's Triton
kernels live in `<op>_triton.py`, imported only when a Triton path runs: lathe imports,
trains and serves where Triton is not installed. Imports only torch (and triton, lazily)."""

if __name__ == "kernels":  # imported from a checkout's root under another package's name
    from lathe.kernels.hub_name import hand_over_name

    hand_over_name()

from lathe.kernels.attention import (
    PLAIN,
    AttentionVariant,
    causal_attention,
    document_starts,
)
from lathe.kernels.dispatch import configure as configure_kernels
from lathe.kernels.dispatch import kernel_enabled, kernels_off, use_triton
from lathe.kernels.fused_ce import linear_cross_entropy
from lathe.kernels.paged_attention import paged_decode
from lathe.kernels.quant_matmul import int4_matmul, int8_matmul
from lathe.kernels.rmsnorm import add_rms_norm, rms_norm
from lathe.kernels.rope import rope
from lathe.kernels.swiglu import swiglu

__all__ = ["PLAIN", "AttentionVariant", "add_rms_norm", "causal_attention", "configure_kernels",
           "document_starts", "int4_matmul", "int8_matmul", "kernel_enabled", "kernels_off",
           "linear_cross_entropy", "paged_decode", "rms_norm", "rope", "swiglu", "use_triton"]
