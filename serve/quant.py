"""Weight-only quantization of linear layers for serving (gpt-fast style).

int8: symmetric, one fp scale per output channel: w ≈ q · scale, q in [-127, 127].
int4: asymmetric, one (scale, minimum) pair per group of `group_size` input columns:
w ≈ q · scale + minimum, q in [0, 15], two values packed per byte (low nibble = even
column). Activations stay in the model's dtype; the matmuls are `lathe.kernels`' (a Triton
dequantize-in-tile matmul on CUDA; torch's int8/int4 CPU GEMMs on CPU, int4 repacked once
into their layout on first use).

A quantized checkpoint is an ordinary checkpoint folder whose config.json carries a
`quantization_config` ({"quant_method": "lathe", "mode", "group_size"}) and whose
safetensors hold each linear's packed weight and scales under the module's name
(`...q_proj.weight`, `...q_proj.scale`, for int4 also `...q_proj.minimum`). A mixture of
experts' stacked experts become one quantized linear per expert and projection
(`...mlp.experts.gate_up.3.weight`, `...mlp.experts.down.3.weight`), each token running
through its own experts' quantized GEMMs. Only lathe loads it (`load_serving_model`, with
`serving_tokenizer` the checkpoint's tokenizer checked against the model); for other
runtimes export GGUF.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import Tensor, nn

from lathe.core.atomic import atomic_directory
from lathe.core.checkpoint_files import GENERATION_CONFIG_FILE, checkpoint_file, read_json_object
from lathe.core.errors import ConfigError
from lathe.data.tokenizer import load_tokenizer
from lathe.kernels.decode_linear import HALF_DTYPES, use_decode_linears
from lathe.kernels.dispatch import use_cpu_kernel
from lathe.kernels.quant_matmul import (
    int4_matmul,
    int4_matmul_cpu,
    int4_pack_for_cpu,
    int8_matmul,
)
from lathe.model.checkpoint import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint,
    load_safetensors,
    read_model_config,
)
from lathe.model.transformer import Experts, MoE, Transformer, gated, run_each_expert
from lathe.serve.config import QuantMode
from lathe.serve.half_weights import use_half_weights
from lathe.serve.host_memory import hold_in_huge_pages

# a server's or chat's weight dtype by name (auto: the checkpoint's own)
WEIGHT_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16}


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 weight, per-output-channel scale) of an (out, in) weight."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(packed uint8 (out, in/2), scales (out, in/group), minimums (out, in/group))."""
    out_features, in_features = weight.shape
    if in_features % group_size or group_size % 2:
        raise ValueError(f"int4: in_features={in_features} must be a multiple of the even "
                         f"group_size={group_size}; use group_size 32 for narrow layers")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(out_features, in_features)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale, low


def _keep_bias(module: nn.Module, linear: nn.Linear) -> None:
    """A quantized linear keeps its layer's bias (Qwen2's q, k, v) in full precision."""
    bias = linear.bias
    module.register_buffer("bias", None if bias is None else bias.detach().clone())


def _add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias.to(y.dtype)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        _keep_bias(self, linear)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        return _add_bias(int8_matmul(x, self.weight, self.scale), self.bias)


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        super().__init__()
        packed, scale, low = quantize_int4(linear.weight.detach(), group_size)
        self.register_buffer("weight", packed)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.register_buffer("minimum", low.to(linear.weight.dtype))
        _keep_bias(self, linear)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        self.cpu_pack: tuple[Tensor, Tensor] | None = None
        self.register_load_state_dict_post_hook(Int4Linear._forget_cpu_pack)

    @staticmethod
    def _forget_cpu_pack(module: Int4Linear, _: object) -> None:
        module.cpu_pack = None

    def forward(self, x: Tensor) -> Tensor:
        if use_cpu_kernel("int4_matmul", x):
            if self.cpu_pack is None:  # repacked once, for torch's CPU int4 GEMM
                self.cpu_pack = int4_pack_for_cpu(self.weight, self.scale, self.minimum)
            return _add_bias(int4_matmul_cpu(x, *self.cpu_pack), self.bias)
        return _add_bias(int4_matmul(x, self.weight, self.scale, self.minimum), self.bias)


def quantized_linear(linear: nn.Linear, mode: QuantMode, group_size: int) -> nn.Module:
    """`linear` as an Int8Linear or Int4Linear (int4: groups of 32 where `group_size`
    does not divide its input width)."""
    if mode == "int8":
        return Int8Linear(linear)
    return Int4Linear(linear, group_size if linear.in_features % group_size == 0 else 32)


class QuantizedExperts(nn.Module):
    """A mixture of experts' stacked experts as one quantized linear per expert and
    projection (gate and up together); each expert that tokens were routed to runs its
    own quantized GEMMs (the quantized GEMMs take one matrix each)."""

    def __init__(self, experts: Experts, mode: QuantMode, group_size: int) -> None:
        super().__init__()

        def linear(weight: Tensor) -> nn.Module:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                              device=weight.device, dtype=weight.dtype)
            plain.weight = nn.Parameter(weight.detach(), requires_grad=False)
            return quantized_linear(plain, mode, group_size)

        self.gate_up = nn.ModuleList(linear(w) for w in experts.gate_up_proj)
        self.down = nn.ModuleList(linear(w) for w in experts.down_proj)
        self.gelu = experts.gelu

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        def mlp(expert: int, rows: Tensor) -> Tensor:
            hidden = gated(*self.gate_up[expert](rows).chunk(2, dim=-1), self.gelu)
            return self.down[expert](hidden)
        return run_each_expert(x, experts, weights, mlp)


def quantize_linears(model: nn.Module, mode: QuantMode, group_size: int = 128) -> int:
    """Replace every `nn.Linear` (and a mixture of experts' experts) of `model` in place;
    returns how many linears were replaced. Routers keep full precision: their top-k
    picks the experts, and they are a sliver of the weights.

    A tied LM head is quantized as its own copy (the embedding lookup keeps full precision).
    For int4, layers narrower than `group_size` fall back to groups of 32.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not isinstance(parent, MoE):
                setattr(parent, name, quantized_linear(child, mode, group_size))
                replaced += 1
            elif isinstance(child, Experts):
                setattr(parent, name, QuantizedExperts(child, mode, group_size))
                replaced += 2 * child.gate_up_proj.shape[0]
    return replaced


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers (what serving streams per decoded token, roughly)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def quantization_config(path: str | Path) -> dict | None:
    """The `quantization_config` of a checkpoint folder, or None for a plain checkpoint."""
    quant = read_json_object(checkpoint_file(path, CONFIG_FILE)).get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "lathe"
                              or quant.get("mode") not in ("int8", "int4")
                              or not isinstance(quant.get("group_size"), int)
                              or quant["group_size"] < 1):
        raise CheckpointError(f"{path}: quantization_config {quant} is not one lathe wrote "
                              "(quant_method 'lathe', mode int8|int4, group_size >= 1)")
    return quant


def save_quantized_checkpoint(source: str | Path, out: str | Path, mode: QuantMode,
                              group_size: int = 128) -> Path:
    """Quantize a checkpoint folder's linears and write the result as a new folder."""
    source = Path(source)
    model = load_checkpoint(source, dtype=torch.float32)
    quantize_linears(model, mode, group_size)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    config = json.loads((source / CONFIG_FILE).read_text())
    config["quantization_config"] = {"quant_method": "lathe", "mode": mode,
                                     "group_size": group_size}
    with atomic_directory(out) as tmp:
        save_file(state, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for name in (GENERATION_CONFIG_FILE, PROVENANCE_FILE, *TOKENIZER_FILES):
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
    return Path(out)


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
    quant = quantization_config(path)
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
    if quantize is not None and quantize != quant["mode"]:
        raise CheckpointError(f"{path} is already quantized to {quant['mode']}; "
                              f"drop --quantize {quantize} or start from the full checkpoint")
    with torch.device("meta"):
        model = Transformer(read_model_config(path))
    quantize_linears(model, quant["mode"], quant["group_size"])
    state = load_safetensors(checkpoint_file(path, WEIGHTS_FILE), device)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    expected = model.state_dict()
    if set(state) != set(expected):
        raise CheckpointError(f"{path}: quantized weights do not match config.json (missing "
                              f"{sorted(set(expected) - set(state))[:4]}, unexpected "
                              f"{sorted(set(state) - set(expected))[:4]})")
    wrong = [f"{name} {tuple(t.shape)} {t.dtype} (expected {tuple(expected[name].shape)} "
             f"{expected[name].dtype})" for name, t in sorted(state.items())
             if t.shape != expected[name].shape or t.is_floating_point()
             != expected[name].is_floating_point()]
    if wrong:
        raise CheckpointError(f"{path}: quantized weights of the wrong shape or kind: "
                              f"{', '.join(wrong[:4])}")
    model.load_state_dict(state, assign=True)
    model.reset_rotary(device)
    return _ready(model.eval())


def _ready(model: Transformer) -> Transformer:
    """The last steps of every load: on the CPU the weights move into huge pages (out of
    the checkpoint's memory-mapped file, whose every page quantizing has read — the 88M model
    at int8 was 819 MiB resident with the mapping kept, 478 MiB without — and 64-byte
    aligned, which torch's int8/int4 GEMMs need); the linears become `DecodeLinear`s."""
    if model.lm_head.weight.device.type == "cpu":
        hold_in_huge_pages(model)
    use_decode_linears(model)
    return model


@torch.inference_mode()
def perplexity(model: Transformer, token_ids: list[int], window: int | None = None) -> float:
    """exp(mean next-token loss) over `token_ids`, in non-overlapping windows of the
    model's context length."""
    window = window or model.config.max_seq_len
    device = model.model.embed_tokens.weight.device
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = torch.tensor([token_ids[start:start + window + 1]], device=device)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).logits[0].float()
        total += float(F.cross_entropy(logits, chunk[0, 1:], reduction="sum"))
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
