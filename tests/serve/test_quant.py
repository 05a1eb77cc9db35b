"""Weight-only int8 / int4 quantization: packing, error bounds against fp32, model swap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.kernels.quant_matmul import dequantize_int4, dequantize_int8
from lathe.model import load_checkpoint
from lathe.model.checkpoint import CheckpointError
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.quant import (
    Int4Linear,
    Int8Linear,
    load_serving_model,
    perplexity,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    weight_bytes,
)
from lathe.serve.sampling_params import SamplingParams
from tests.builders import tiny_model


def test_int8_round_trip_error_is_within_half_a_step():
    """Over [-128, 127] with max |w| / 127.5 a step, the largest weight is half a step off."""
    w = torch.randn(96, 160)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    assert ((dequantize_int8(q, scale) - w).abs() <= scale[:, None] / 2 * (1 + 1e-4)).all()


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_packs_two_per_byte_and_stays_within_half_a_step(group_size):
    w = torch.randn(64, 256)
    packed, scale, low = quantize_int4(w, group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128)
    assert scale.shape == (64, 256 // group_size)
    error = (dequantize_int4(packed, scale, low) - w).abs()
    step = scale.repeat_interleave(group_size, dim=1)
    assert (error <= step / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="multiple of the even group_size"):
        quantize_int4(torch.randn(4, 48), 32)


def test_quantized_matmul_error_against_fp32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 256, bias=False)
    x = torch.randn(8, 512)
    reference = linear(x)
    relative = {}
    for name, layer in (("int8", Int8Linear.quantize(linear)),
                        ("int4-128", Int4Linear.quantize(linear, 128)),
                        ("int4-32", Int4Linear.quantize(linear, 32))):
        relative[name] = ((layer(x) - reference).norm() / reference.norm()).item()
    # measured: int8 0.40 %, int4 g128 6.5 %, g32 6.2 % relative Frobenius error
    assert relative["int8"] < 0.01
    assert relative["int4-32"] < relative["int4-128"] < 0.08


def test_every_linear_but_the_head_is_swapped_and_logits_stay_close():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        quantize_linears(model, "int8")
        assert [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                ] == ["lm_head"]
        quantized = model(ids).logits
    assert ((quantized - reference).norm() / reference.norm()).item() < 0.02


def test_quantized_checkpoint_round_trip_serves_the_same_logits(checkpoint, tmp_path, capsys):
    ids = torch.randint(0, 400, (1, 40))
    full = load_checkpoint(checkpoint)
    for mode in ("int8", "int4"):
        out = tmp_path / mode
        assert main(["export", str(checkpoint), "--format", "quantized", "--quantize", mode,
                     "--group-size", "32", "--out", str(out)]) == 0
        assert "MiB" in capsys.readouterr().out
        loaded = load_serving_model(out)
        in_memory = load_serving_model(checkpoint, quantize=mode, group_size=32)
        with torch.inference_mode():
            assert torch.equal(loaded(ids).logits, in_memory(ids).logits)
        ratio = weight_bytes(loaded) / weight_bytes(full)
        assert ratio < (0.45 if mode == "int8" else 0.4)  # fp32 embedding stays
        assert abs(perplexity(loaded, ids[0].tolist()) / perplexity(full, ids[0].tolist())
                   - 1) < (0.02 if mode == "int8" else 0.2)
        engine = LLMEngine.from_checkpoint(out, EngineConfig(num_blocks=32))
        assert engine.generate([ids[0, :9].tolist()], SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(CheckpointError, match="already quantized to int4"):
        load_serving_model(tmp_path / "int4", quantize="int8")


def test_perplexity_scores_each_windows_next_token_through_the_chunked_loss():
    """Perplexity is exp of the mean next-token cross-entropy over the text, in windows of
    the context that each score their next token too (none is left out between windows):
    the full logits' value, computed through the chunked loss (which never holds them)."""
    import torch.nn.functional as F
    model = tiny_model(max_seq_len=16)
    ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        logits = torch.cat([model(torch.tensor([ids[s:s + 15]])).logits[0]
                            for s in range(0, 44, 15)])
    reference = torch.exp(F.cross_entropy(logits[:44], torch.tensor(ids[1:]))).item()
    assert perplexity(model, ids) == pytest.approx(reference, rel=1e-5)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_served_model_holds_no_view_of_the_checkpoint_file(tmp_path, quantize):
    """Served on the CPU, the weights live in memory of their own (huge pages): no mapping
    of the checkpoint's file stays, which would keep every page a load (and quantizing)
    read resident beside them."""
    import gc

    from lathe.model import load_checkpoint, save_checkpoint

    folder = save_checkpoint(tiny_model(), tmp_path / "ckpt")
    weights = str((folder / "model.safetensors").resolve())

    def mapped() -> bool:
        gc.collect()
        return weights in Path("/proc/self/maps").read_text()

    plain = load_checkpoint(folder)
    assert mapped()  # what the copy is for: a plain load views the file
    del plain
    served = load_serving_model(folder, quantize=quantize, device="cpu")
    assert not mapped()
    with torch.no_grad():
        assert served(torch.randint(0, 256, (1, 8))).logits.isfinite().all()
