"""Half-precision weights for a model that computes in float32 on the CPU: how `lathe serve`
holds a bf16 (or fp16) checkpoint there, and a float32 one given `--dtype bfloat16`.

A decode step on the CPU streams every weight once a token, so its speed is the weights'
bytes; the activations, norms, attention and KV cache are a sliver of them. Here the linears'
weights and the embedding table (which a tied LM head shares) stay in half precision, and
everything else — norms, biases, a mixture's router and stacked experts, the residual stream —
in float32, as llama.cpp computes an f16 or bf16 GGUF. The linears' matmuls are
`lathe.kernels.decode_linear.linear`'s: the native op at every row count, prefill's too
(AVX-512 BF16 dot products on x rounded to bf16 where the CPU has them, AMX tiles from 16
rows where it has those, else the weights widened in registers); the embedding widens the
rows it looks up. A mixture's stacked experts stay float32: their grouped GEMM takes one
dtype, and widening every expert each step would cost more than the bytes saved.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lathe.kernels.decode_linear import HALF_DTYPES, use_decode_linears
from lathe.model.transformer import MoE, Transformer


class WidenedEmbedding(nn.Embedding):
    """An `nn.Embedding` (the same parameter and state dict) whose table is stored in half
    precision and whose lookups come out in float32."""

    def forward(self, input_ids: Tensor) -> Tensor:
        return super().forward(input_ids).float()


@torch.no_grad()
def use_half_weights(model: Transformer, dtype: torch.dtype) -> None:
    """In place: `model`'s linear weights and embedding table in `dtype` (bf16 or fp16),
    every other floating tensor in float32; its embedding a `WidenedEmbedding`, its linears
    `DecodeLinear`s (a plain `nn.Linear` takes no float32 x times a half weight)."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half weights are bfloat16 or float16, not {dtype}")
    half = {id(model.model.embed_tokens.weight)}
    for parent in model.modules():
        if isinstance(parent, MoE):
            continue  # its router: top-k over its scores picks the experts
        for child in parent.children():
            if isinstance(child, nn.Linear):
                half.add(id(child.weight))
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype if id(tensor) in half else torch.float32)
    model.model.embed_tokens.__class__ = WidenedEmbedding
    use_decode_linears(model)


def activation_dtype(model: Transformer) -> torch.dtype:
    """The dtype `model`'s hidden states (and so its KV cache) run in."""
    embed = model.model.embed_tokens
    return torch.float32 if isinstance(embed, WidenedEmbedding) else embed.weight.dtype
