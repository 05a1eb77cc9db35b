"""Quantization of linear layers for serving (gpt-fast style), rounded as compressed-tensors
rounds llm-compressor's W8A16, W4A16_ASYM and FP8_DYNAMIC schemes.

int8: symmetric, one fp scale per output channel: w ≈ q · scale, q in [-128, 127].
int4: asymmetric, one (scale, integer zero point) pair per group of `group_size` input
columns, held as w ≈ q · scale + minimum with q in [0, 15] and minimum = −(zero point + 8)
· scale, two values packed per byte (low nibble = even column). For both the activations
stay in the model's dtype; the matmuls are `lathe.kernels`' (a Triton dequantize-in-tile
matmul on CUDA; torch's int8/int4 CPU GEMMs on CPU, int4 repacked once into their layout on
first use). fp8: float8 e4m3 weights with one float32 scale per output channel, and each
token's inputs rounded to float8 by its own scale as it runs (W8A8,
`lathe.kernels.fp8_matmul`: FP8 tensor cores where the GPU has them). The LM head and MoE
routers keep full precision. A mixture of experts' stacked experts become one quantized
linear per expert and projection (`...mlp.experts.gate_up.3`, `...mlp.experts.down.3`), each
token running through its own experts' quantized GEMMs.

A quantized checkpoint is compressed-tensors' (`lathe.serve.quant_format`): lathe writes
it, and loads it or a hub W4A16 / W8A16 / FP8-dynamic checkpoint with `load_serving_model`
(`serving_tokenizer` the checkpoint's tokenizer checked against the model).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from lathe.core.checkpoint_files import checkpoint_file
from lathe.core.errors import ConfigError
from lathe.data.tokenizer import load_tokenizer
from lathe.kernels.decode_linear import HALF_DTYPES, use_decode_linears
from lathe.kernels.dispatch import use_cpu_kernel
from lathe.kernels.fp8_matmul import fp8_matmul, quantize_fp8_rows, uses_tensor_cores
from lathe.kernels.quant_matmul import (
    int4_matmul,
    int4_matmul_cpu,
    int4_pack_for_cpu,
    int8_matmul,
)
from lathe.model.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_model_config,
)
from lathe.model.gated_delta_net import GatedDeltaNet
from lathe.model.transformer import Experts, MoE, Transformer, gated, run_each_expert
from lathe.serve.config import QuantMode
from lathe.serve.half_weights import activation_dtype, use_half_weights
from lathe.serve.host_memory import hold_in_huge_pages
from lathe.serve.quant_format import (
    GROUP_SIZES,
    read_quant_scheme,
    read_quantized_weights,
    write_quantized_checkpoint,
)

# a server's or chat's weight dtype by name (auto: the checkpoint's own)
WEIGHT_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16}


def _nonzero(scale: Tensor) -> Tensor:
    """A zero scale (an all-zero row or group) as the dtype's epsilon, as compressed-tensors
    sets it, so that quantizing divides by something."""
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 weight, per-output-channel scale) of an (out, in) weight: symmetric over
    [-128, 127], scale = max |w| / 127.5 — compressed-tensors' W8A16 rounding."""
    w = weight.float()
    scale = _nonzero(w.abs().amax(dim=1) / 127.5)
    q = torch.round(torch.clamp(w / scale[:, None], -128, 127)).to(torch.int8)
    return q, scale


def pack_nibbles(q: Tensor) -> Tensor:
    """(out, in) values in [0, 15] as (out, in / 2) bytes, the low nibble an even column."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(packed uint8 (out, in/2), scales (out, in/group), minimums (out, in/group)):
    asymmetric in groups of `group_size` input columns with an integer zero point, as
    compressed-tensors' W4A16_ASYM rounds them (each group's range widened to hold 0);
    w ≈ q · scale + minimum with q in [0, 15] and minimum = −(zero_point + 8) · scale."""
    out_features, in_features = weight.shape
    if in_features % group_size or group_size % 2:
        raise ValueError(f"int4: in_features={in_features} must be a multiple of the even "
                         f"group_size={group_size}; use group_size 32 for narrow layers")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low = groups.amin(dim=-1).clamp(max=0)
    high = groups.amax(dim=-1).clamp(min=0)
    scale = _nonzero((high - low) / 15)
    zero_point = torch.round(torch.clamp(-8 - low / scale, -8, 7))
    q = torch.round(torch.clamp(groups / scale[..., None] + zero_point[..., None], -8, 7))
    packed = pack_nibbles((q + 8).to(torch.uint8).reshape(out_features, in_features))
    return packed, scale, -(zero_point + 8) * scale


def _keep_bias(module: nn.Module, bias: Tensor | None) -> None:
    """A quantized linear keeps its layer's bias (Qwen2's q, k, v) in full precision."""
    module.register_buffer("bias", None if bias is None else bias.detach().clone())


def _add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias.to(y.dtype)


class RowScaledLinear(nn.Module):
    """An 8-bit weight (int8 or float8) with one scale per output row, and its layer's
    bias."""

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        _keep_bias(self, bias)
        self.out_features, self.in_features = q.shape


class Int8Linear(RowScaledLinear):
    @classmethod
    def quantize(cls, linear: nn.Linear) -> Int8Linear:
        q, scale = quantize_int8(linear.weight.detach())
        return cls(q, scale.to(linear.weight.dtype), linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return _add_bias(int8_matmul(x, self.weight, self.scale), self.bias)


class Int4Linear(nn.Module):
    def __init__(self, packed: Tensor, scale: Tensor, minimum: Tensor,
                 bias: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        _keep_bias(self, bias)
        self.out_features, self.in_features = packed.shape[0], 2 * packed.shape[1]
        self.group_size = self.in_features // scale.shape[1]
        self.cpu_pack: tuple[Tensor, Tensor] | None = None
        self.register_load_state_dict_post_hook(Int4Linear._forget_cpu_pack)

    @classmethod
    def quantize(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        packed, scale, minimum = quantize_int4(linear.weight.detach(), group_size)
        dtype = linear.weight.dtype
        return cls(packed, scale.to(dtype), minimum.to(dtype), linear.bias)

    @staticmethod
    def _forget_cpu_pack(module: Int4Linear, _: object) -> None:
        module.cpu_pack = None

    def forward(self, x: Tensor) -> Tensor:
        if use_cpu_kernel("int4_matmul", x):
            if self.cpu_pack is None:  # repacked once, for torch's CPU int4 GEMM
                self.cpu_pack = int4_pack_for_cpu(self.weight, self.scale, self.minimum)
            return _add_bias(int4_matmul_cpu(x, *self.cpu_pack), self.bias)
        return _add_bias(int4_matmul(x, self.weight, self.scale, self.minimum), self.bias)


class Fp8Linear(RowScaledLinear):
    """W8A8 FP8 (compressed-tensors' FP8_DYNAMIC): a float8 weight with one float32 scale
    per output row, each input row rounded to float8 by its own scale as it is multiplied
    (`lathe.kernels.fp8_matmul`). Where FP8 tensor cores are missing (the CPU, older GPUs)
    the weight is also held widened to bfloat16 (`widen`: at load, or on first use)."""

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        super().__init__(q, scale, bias)
        # a buffer (so it counts in the bytes a step reads, and moves with the model) that
        # no state dict holds
        self.register_buffer("widened", None, persistent=False)
        self.register_load_state_dict_post_hook(Fp8Linear._forget_widened)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        q, scale = quantize_fp8_rows(linear.weight.detach())
        return cls(q, scale, linear.bias)

    @staticmethod
    def _forget_widened(module: Fp8Linear, _: object) -> None:
        module.widened = None

    def widen(self, dtype: torch.dtype) -> None:
        """Hold the weight widened to bfloat16 if inputs of `dtype` will not meet it on FP8
        tensor cores here."""
        probe = torch.empty(0, self.in_features, dtype=dtype, device=self.weight.device)
        if self.widened is None and not uses_tensor_cores(probe, self.weight):
            self.widened = self.weight.to(torch.bfloat16)

    def forward(self, x: Tensor) -> Tensor:
        if uses_tensor_cores(x, self.weight):
            return _add_bias(fp8_matmul(x, self.weight, self.scale), self.bias)
        self.widen(x.dtype)
        return _add_bias(fp8_matmul(x, self.weight, self.scale, self.widened), self.bias)


def int4_group_size(in_features: int, group_size: int) -> int:
    """The int4 group size of a linear `in_features` wide: `group_size`, or 32 where that
    does not divide it."""
    return group_size if in_features % group_size == 0 else 32


def quantized_linear(linear: nn.Linear, mode: QuantMode, group_size: int) -> nn.Module:
    """`linear` as an Int8Linear, Fp8Linear or Int4Linear (int4 in `int4_group_size`
    groups)."""
    if mode == "int8":
        return Int8Linear.quantize(linear)
    if mode == "fp8":
        return Fp8Linear.quantize(linear)
    return Int4Linear.quantize(linear, int4_group_size(linear.in_features, group_size))


class QuantizedExperts(nn.Module):
    """A mixture of experts' stacked experts as one quantized linear per expert and
    projection (gate and up together); each expert that tokens were routed to runs its
    own quantized GEMMs (the quantized GEMMs take one matrix each)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], gelu: bool) -> None:
        super().__init__()
        self.gate_up, self.down, self.gelu = nn.ModuleList(gate_up), nn.ModuleList(down), gelu

    @classmethod
    def quantize(cls, experts: Experts, mode: QuantMode, group_size: int) -> QuantizedExperts:
        def linear(weight: Tensor) -> nn.Module:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                              device=weight.device, dtype=weight.dtype)
            plain.weight = nn.Parameter(weight.detach(), requires_grad=False)
            return quantized_linear(plain, mode, group_size)

        return cls([linear(w) for w in experts.gate_up_proj],
                   [linear(w) for w in experts.down_proj], experts.gelu)

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        def mlp(expert: int, rows: Tensor) -> Tensor:
            hidden = gated(*self.gate_up[expert](rows).chunk(2, dim=-1), self.gelu)
            return self.down[expert](hidden)
        return run_each_expert(x, experts, weights, mlp)


def quantize_linears(model: nn.Module, mode: QuantMode, group_size: int = 128,
                     only: set[str] | None = None) -> int:
    """Replace the linears of `model` in place (the ones named in `only`, when given, a
    mixture of experts' by its `Experts` module's name); returns how many linears were
    replaced. The LM head and the routers keep full precision, as llm-compressor's recipes
    keep them: a head's rounding reaches every logit, a router's top-k picks the experts,
    and both are slivers of the weights; so do a Gated DeltaNet's per-head decay and
    learning-rate projections (`in_proj_a`, `in_proj_b`: a row per value head, exponentiated
    into every later token's state). For int4, layers narrower than `group_size` fall
    back to groups of 32."""
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full_name = f"{parent_name}.{name}" if parent_name else name
            if full_name == "lm_head" or (only is not None and full_name not in only) or (
                    isinstance(parent, GatedDeltaNet) and name in ("in_proj_a", "in_proj_b")):
                continue
            if isinstance(child, nn.Linear) and not isinstance(parent, MoE):
                setattr(parent, name, quantized_linear(child, mode, group_size))
                replaced += 1
            elif isinstance(child, Experts):
                setattr(parent, name, QuantizedExperts.quantize(child, mode, group_size))
                replaced += 2 * child.gate_up_proj.shape[0]
    return replaced


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (Int8Linear, Int4Linear, Fp8Linear)) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers (what serving streams per decoded token, roughly)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save_quantized_checkpoint(source: str | Path, out: str | Path, mode: QuantMode,
                              group_size: int = 128) -> Path:
    """Quantize a checkpoint folder's linears and write the result as a new folder, in
    compressed-tensors' format (`lathe.serve.quant_format`: vLLM and transformers load it)."""
    source = Path(source)
    model = load_checkpoint(source, dtype=torch.float32)
    quantize_linears(model, mode, group_size)
    return write_quantized_checkpoint(model, model.config, source, Path(out), mode, group_size)


def load_serving_model(path: str | Path, quantize: QuantMode | None = None,
                       group_size: int = 128, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> Transformer:
    """A checkpoint ready to serve: a quantized checkpoint as written, or a plain one,
    optionally quantized at load. On the GPU when there is one, unless `device` says; there
    `dtype` (default: the checkpoint's) is every weight's and the activations'. On the CPU
    the activations are float32: a bf16 or fp16 checkpoint (or `dtype` bf16/fp16) keeps its
    linears and embedding in half precision (`lathe.serve.half_weights`), `dtype` float32
    or `quantize` makes the rest float32, and the weights are held in huge pages
    (`lathe.serve.host_memory`). Its full-precision linears are `DecodeLinear`s: on the
    CPU a float32 decode step's few rows take lathe's native op (1.6× the single-stream
    tokens/s of BLAS's on a 88M model), and every row of a half one."""
    read_model_config(path).require_language_model(f"serving {path}")
    device = torch.device(device if device is not None else
                          "cuda" if torch.cuda.is_available() else "cpu")
    quant = read_quant_scheme(path)
    if quant is None:
        if device.type != "cpu":
            model = load_checkpoint(path, dtype=dtype, device=device)
        else:
            if dtype in HALF_DTYPES and quantize is not None:
                raise ConfigError(f"dtype {str(dtype).removeprefix('torch.')} is for a model "
                                  f"served unquantized; with quantize {quantize} the weights "
                                  "that stay are float32 — drop one of them")
            model = load_checkpoint(path, device=device, dtype=torch.float32 if (
                quantize is not None or dtype == torch.float32) else None)
            half = dtype if dtype is not None else model.model.embed_tokens.weight.dtype
            if half in HALF_DTYPES:
                use_half_weights(model, half)
        if quantize is not None:
            quantize_linears(model, quantize, group_size)
        return _ready(model)
    if quantize is not None and quantize != quant.mode:
        raise CheckpointError(f"{path} is already quantized to {quant.mode}; "
                              f"drop --quantize {quantize} or start from the full checkpoint")
    if device.type == "cpu" and dtype in HALF_DTYPES:
        raise ConfigError(f"dtype {str(dtype).removeprefix('torch.')}: {path} is quantized "
                          f"({quant.mode}), and on the CPU what stays full precision is "
                          "float32; drop the dtype")
    config = read_model_config(path)
    with torch.device("meta"):
        model = Transformer(config)
    state, quantized = read_quantized_weights(Path(path), config, quant, device)
    quantize_linears(model, quant.mode, quant.group_size or GROUP_SIZES[-1], only=quantized)
    if config.tie_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    if dtype is None:  # the CPU's activations; on a GPU the checkpoint's (a hub one's bf16)
        dtype = torch.float32 if device.type == "cpu" else \
            state["model.embed_tokens.weight"].dtype
    kept = {f"{name}.{buffer}" for name, module in model.named_modules()
            if isinstance(module, Fp8Linear) for buffer in ("weight", "scale")}
    state = {k: v.to(dtype) if v is not None and v.is_floating_point() and k not in kept
             else v for k, v in state.items()}
    expected = model.state_dict()
    if set(state) != set(expected):
        raise CheckpointError(f"{path}: quantized weights do not match config.json (missing "
                              f"{sorted(set(expected) - set(state))[:4]}, unexpected "
                              f"{sorted(set(state) - set(expected))[:4]})")
    wrong = [f"{name} {tuple(t.shape)} {t.dtype} (expected {tuple(expected[name].shape)} "
             f"{expected[name].dtype})" for name, t in sorted(state.items())
             if t is None or t.shape != expected[name].shape or t.is_floating_point()
             != expected[name].is_floating_point()]
    if wrong:
        raise CheckpointError(f"{path}: quantized weights of the wrong shape or kind: "
                              f"{', '.join(wrong[:4])}")
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.reset_rotary(device)
    return _ready(model.eval())


def _ready(model: Transformer) -> Transformer:
    """The last steps of every load: FP8 linears widen their weights where the device will
    want them so (`Fp8Linear.widen`: before any graph is traced or captured, so that none is
    made inside one); on the CPU the weights move into huge pages (out of the checkpoint's
    memory-mapped file, whose every page quantizing has read — the 88M model at int8 was 819
    MiB resident with the mapping kept, 478 MiB without — and 64-byte aligned, which torch's
    int8/int4 GEMMs need); the linears become `DecodeLinear`s."""
    dtype = activation_dtype(model)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.widen(dtype)
    if model.lm_head.weight.device.type == "cpu":
        hold_in_huge_pages(model)
    use_decode_linears(model)
    return model


@torch.inference_mode()
def perplexity(model: Transformer, token_ids: list[int], window: int | None = None) -> float:
    """exp(mean next-token loss) over `token_ids`, in non-overlapping windows of the
    model's context length, each scored with its next token (so a window's forward holds
    one more token than it scores). The loss is the chunked one: a long text on a large
    vocabulary never holds its (tokens × vocab) logits."""
    window = window or model.config.max_seq_len - 1
    device = model.model.embed_tokens.weight.device
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = torch.tensor([token_ids[start:start + window + 1]], device=device)
        if chunk.shape[1] < 2:
            break
        loss = model(chunk, labels=chunk, return_logits=False).loss
        total += float(loss) * (chunk.shape[1] - 1)
        count += chunk.shape[1] - 1
    return float(torch.exp(torch.tensor(total / count)))


def serving_tokenizer(path: Path, vocab_size: int) -> Tokenizer | None:
    """The checkpoint's tokenizer (None without tokenizer.json), checked against the model."""
    file = checkpoint_file(path, "tokenizer.json")
    if not file.is_file():
        return None
    tokenizer = load_tokenizer(path)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise CheckpointError(f"{file}: {size} tokens, but the model's vocab_size is "
                              f"{vocab_size}; this tokenizer belongs to another model")
    return tokenizer
