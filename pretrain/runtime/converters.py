"""Model transforms applied from outside the model, before accelerate wraps it (torchtitan's
"converters"): FP8 linears through torchao, per-block activation checkpointing, and
per-block `torch.compile`. None of them renames a parameter, so checkpoints keep HF names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lathe.model.transformer import Transformer
from lathe.pretrain.runtime.config import PrecisionConfig

FP8_DIVISOR = 16  # torch._scaled_mm needs both matmul dimensions divisible by 16


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """Linears FP8 suits: not the LM head (its logits feed the loss, as in torchtitan and
    accelerate's AO recipe) nor a mixture of experts' router (its top-k picks the experts),
    and only shapes `_scaled_mm` accepts."""
    if not isinstance(module, nn.Linear) or name.endswith(("lm_head", ".mlp.gate")):
        return False
    return module.in_features % FP8_DIVISOR == 0 and module.out_features % FP8_DIVISOR == 0


def convert_to_fp8(model: Transformer, emulate: bool) -> list[str]:
    """Swap eligible linears for torchao's Float8Linear (dynamic tensorwise scaling), each
    padding its token count to a multiple of 16 (`pad_tokens_for_fp8`).

    `emulate` runs the FP8 casts and scaled matmuls in higher precision, which is how
    the same path trains on CPUs and GPUs without FP8 tensor cores. Returns the names of
    the converted layers.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = [name for name, module in model.named_modules() if fp8_eligible(module, name)]
    convert_to_float8_training(model, module_filter_fn=fp8_eligible,
                               config=Float8LinearConfig(emulate=emulate))
    for name in converted:
        pad_tokens_for_fp8(model.get_submodule(name))
    return converted


def pad_tokens_for_fp8(linear: nn.Module) -> None:
    """Give `linear` inputs whose token count (all dimensions but the last) is a multiple
    of 16, by appending zero rows and dropping their outputs.

    The token count is the M of the forward GEMM and the inner dimension of the weight
    gradient's, and `torch._scaled_mm` needs both divisible by 16; a batch of
    micro_batch × (seq_len + 1) tokens (8 × 4097) seldom is. Zero rows leave the tensorwise
    amax, every real output row and the weight gradient unchanged, so the loss is exact.
    """
    linear.__class__ = _subclass(type(linear), "Padded", _padded_forward)


def _padded_forward(base_forward: Callable[..., Tensor], self: nn.Module, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1]
    extra = -rows % FP8_DIVISOR
    if not extra:
        return base_forward(self, x)
    out = base_forward(self, F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, extra)))
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def enable_activation_checkpointing(model: Transformer) -> None:
    """Recompute each decoder block's activations in the backward pass instead of keeping them."""
    for layer in model.model.layers:
        layer.__class__ = _subclass(type(layer), "Checkpointed", _checkpointed_forward)


def _checkpointed_forward(base_forward: Callable[..., Tensor], self: nn.Module, *args,
                          **kwargs) -> Tensor:
    return checkpoint(base_forward, self, *args, use_reentrant=False, **kwargs)


@functools.cache
def _subclass(cls: type, prefix: str,
              wrapper: Callable[..., Tensor]) -> type:
    """`cls` with its forward wrapped, for a module's `__class__` (as FSDP2 does): parameter
    names stay HF's, and every block shares one forward, so a compiled block's graph serves
    all of them. A forward set on each instance instead made dynamo guard on the instance's
    function, recompile per block and, past its recompile limit, run the rest eagerly (FP8
    pretraining at half bf16's speed on an H200); with activation checkpointing it was not
    compiled at all. The subclass keeps `cls`'s name: accelerate finds FSDP2's units by it
    (`fsdp_transformer_layer_cls_to_wrap: DecoderLayer`), and a checkpointed block named
    otherwise failed every FSDP2 launch with "Could not find the transformer layer class";
    `prefix` only tells the cached subclasses apart."""
    base_forward = cls.forward

    def forward(self: nn.Module, *args, **kwargs) -> Tensor:
        return wrapper(base_forward, self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": f"{prefix}.{cls.__qualname__}"})


def compile_blocks(model: Transformer) -> None:
    """`torch.compile` each decoder block in place (regional compilation: one compiled
    graph reused by every block, fast to compile, names unchanged)."""
    for layer in model.model.layers:
        layer.compile()


def apply_converters(model: Transformer, config: PrecisionConfig, device: torch.device) -> dict:
    """Apply what `config` asks for, in the order that composes (FP8, then AC, then compile)."""
    applied: dict = {}
    if config.fp8:
        emulate = not fp8_supported(device)
        applied["fp8_layers"] = len(convert_to_fp8(model, emulate=emulate))
        applied["fp8_emulated"] = emulate
        if model.config.n_experts:
            applied["fp8_not_experts"] = ("the experts' grouped GEMMs and the routers stay in "
                                          "the compute dtype: torchao's float8 training "
                                          "converts nn.Linear layers (attention, dense MLPs)")
    if config.activation_checkpointing:
        enable_activation_checkpointing(model)
        applied["activation_checkpointing"] = True
    if config.compile:
        compile_blocks(model)
        applied["compile"] = True
    return applied


def fp8_supported(device: torch.device) -> bool:
    """Real FP8 matmuls need compute capability 8.9+ (Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
