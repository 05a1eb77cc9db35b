"""Single-process pretraining runs, in process: learning, resume, FP8, Muon, accumulation,
activation checkpointing, run length, export and monitoring."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.data.tokenizer import load_tokenizer
from lathe.model import ModelConfig, Transformer
from lathe.model.checkpoint import load_checkpoint
from lathe.pretrain.evaluate import sample_continuations
from lathe.pretrain.runtime.trainer import Runtime, _no_tied_head_notice
from lathe.pretrain.train import lm_loss, pretrain
from tests import processes
from tests.builders import reset_accelerate
from tests.pretrain.conftest import build, run_config, step_losses


def test_loss_falls_and_run_writes_everything(corpus, tmp_path, caplog):
    out = tmp_path / "run"
    summary = pretrain(build(run_config(corpus, out, max_steps=24)))
    # accelerate's notice that it dropped the tied LM head is not shown at every save
    assert not [r for r in caplog.records if "shared tensor" in r.getMessage()]
    losses = step_losses(out)
    assert sorted(losses) == list(range(1, 25))
    assert losses[24] < losses[1] - 1.5, losses
    assert summary["val/loss"] < losses[1] and 0 < summary["val/bpb"] < 8
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_record = next(r for r in records if r["step"] == 24 and "loss" in r)
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "tokens_seen", "memory/rss_gib"):
        assert key in step_record
    assert 0 < step_record["mfu"] < 1
    assert any("samples" in r for r in records)
    assert [p.name for p in sorted((out / "state").iterdir())] == ["step-00000020",
                                                                   "step-00000024"]
    model = load_checkpoint(out / "final")
    provenance = json.loads((out / "final" / "lathe.json").read_text())
    assert provenance["stage"] == "pretrain" and provenance["steps"] == 24
    assert provenance["tokens_seen"] == 24 * 8 * 32 == summary["tokens_seen"]
    assert (out / "final" / "tokenizer.json").is_file()
    assert model.config.vocab_size == 512 and model.config.n_layers == 2


# a mixture of experts balanced without a loss: its selection biases, moved every step, are
# resumable state too
BALANCED_MOE = {"model.overrides": {"family": "glm4_moe", "dim": 64, "n_layers": 2,
                                    "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
                                    "n_experts": 4, "moe_ffn_hidden_dim": 64},
                "router_bias_update_speed": 0.01}


@pytest.mark.parametrize("model", [{}, BALANCED_MOE], ids=["dense", "glm4_moe-balanced"])
def test_interrupted_run_resumes_bit_exact(corpus, tmp_path, monkeypatch, model):
    reference = tmp_path / "reference"
    pretrain(build(run_config(corpus, reference, **model)))

    interrupted = tmp_path / "interrupted"
    real_step = Runtime.train_step

    def dies_at_step_7(self, *args, **kwargs):
        if self.step == 6:
            raise KeyboardInterrupt  # after states at 4 and metrics up to step 6
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Runtime, "train_step", dies_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        pretrain(build(run_config(corpus, interrupted, **model)))
    assert max(step_losses(interrupted)) == 6
    monkeypatch.setattr(Runtime, "train_step", real_step)
    reset_accelerate()

    pretrain(build(run_config(corpus, interrupted, **model)), resume="auto")
    assert step_losses(interrupted) == step_losses(reference)  # exact, steps 1..12
    assert step_losses(interrupted, "val/loss") == step_losses(reference, "val/loss")
    final_a = load_checkpoint(reference / "final").state_dict()
    final_b = load_checkpoint(interrupted / "final").state_dict()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_resume_rejects_a_different_batch_geometry(corpus, tmp_path):
    out = tmp_path / "run"
    pretrain(build(run_config(corpus, out, max_steps=4)))
    with pytest.raises(ConfigError, match="batch_size"):
        pretrain(build(run_config(corpus, out, max_steps=8, micro_batch_size=4)),
                 resume="auto")
    with pytest.raises(ConfigError, match="not a complete training-state folder"):
        pretrain(build(run_config(corpus, out)), resume=str(tmp_path / "nowhere"))


def test_gradient_accumulation_matches_the_larger_batch(corpus, tmp_path):
    pretrain(build(run_config(corpus, tmp_path / "a", max_steps=6)))
    pretrain(build(run_config(corpus, tmp_path / "b", max_steps=6, micro_batch_size=4,
                              grad_accum_steps=2)))
    a, b = step_losses(tmp_path / "a"), step_losses(tmp_path / "b")
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5


def test_activation_checkpointing_changes_memory_not_numbers(corpus, tmp_path):
    pretrain(build(run_config(corpus, tmp_path / "a", max_steps=6)))
    summary = pretrain(build(run_config(corpus, tmp_path / "b", max_steps=6,
                                        **{"precision.activation_checkpointing": True})))
    assert summary["converters"] == {"activation_checkpointing": True}
    a, b = step_losses(tmp_path / "a"), step_losses(tmp_path / "b")
    assert max(abs(a[s] - b[s]) for s in a) < 1e-6


def test_fp8_emulation_trains_close_to_fp32(corpus, tmp_path):
    """torchao Float8Linear (emulated off-GPU) on every eligible linear, 50 steps."""
    settings = dict(max_steps=50, **{"eval.every": 50, "checkpoint.every": 50})
    pretrain(build(run_config(corpus, tmp_path / "fp32", **settings)))
    summary = pretrain(build(run_config(corpus, tmp_path / "fp8", **settings,
                                        **{"precision.fp8": True})))
    assert summary["converters"] == {"fp8_layers": 14, "fp8_emulated": True}  # 7 per layer
    fp32, fp8 = step_losses(tmp_path / "fp32"), step_losses(tmp_path / "fp8")
    assert fp8[50] < fp8[1] - 2.0
    # Measured: 0.0% at step 1, at most 6% on one step, 3.8% over the last 10 (e4m3
    # tensorwise scaling on a 64-wide model). A wrong scale or cast is off by far more.
    assert max(abs(fp8[s] / fp32[s] - 1) for s in fp32) < 0.08
    last = range(41, 51)
    assert abs(sum(fp8[s] for s in last) / sum(fp32[s] for s in last) - 1) < 0.05
    load_checkpoint(tmp_path / "fp8" / "final")  # plain linears again, HF names


def test_a_phi3_model_pretrains_under_fp8_and_checkpointing_and_exports_fused(corpus,
                                                                              tmp_path):
    """Another family through the same converters: torchao's FP8 linears and activation
    checkpointing wrap Phi-3's split projections, and the export joins them again."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "phi3"
    summary = pretrain(build(run_config(corpus, out, max_steps=8, **{
        "model.overrides.family": "phi3", "model.overrides.sliding_window": 16,
        "precision.fp8": True, "precision.activation_checkpointing": True})))
    assert summary["converters"]["fp8_layers"] == 14
    losses = step_losses(out)
    assert losses[8] < losses[1]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert type(theirs).__name__ == "Phi3ForCausalLM"
    ours = load_checkpoint(out / "final")
    ids = torch.randint(0, ours.config.vocab_size, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_muon_and_wsd_and_z_loss_train(corpus, tmp_path):
    out = tmp_path / "muon"
    pretrain(build(run_config(corpus, out, max_steps=16, **{
        "optim.name": "muon", "optim.lr": 2e-2, "schedule.kind": "wsd",
        "precision.z_loss": 1e-4})))
    losses, z = step_losses(out), step_losses(out, "z_loss")
    assert losses[16] < losses[1] - 1.0
    assert sorted(z) == sorted(losses) and all(v > 0 for v in z.values())
    lrs = step_losses(out, "lr")
    assert lrs[2] == pytest.approx(2e-2) and lrs[12] == pytest.approx(2e-2)
    assert lrs[16] == pytest.approx(2e-3)  # WSD decays to min_lr_ratio at the end


def test_run_length_from_tokens_per_parameter(corpus, tmp_path):
    config = build(run_config(corpus, tmp_path / "r", max_steps=None, tokens_per_param=0.02))
    tokens_per_step = 8 * 32
    params = config.model.build(512).num_params()
    summary = pretrain(config)
    assert summary["steps"] == -(-int(0.02 * params) // tokens_per_step)


def test_document_masked_loss_is_each_document_alone():
    """With the separator, a window's loss is the mean over its tokens of each one
    predicted from its own document alone; the token before a separator predicts it."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=64, n_layers=2,
                                                max_seq_len=64)).double()
    window = torch.randint(1, 64, (1, 33))
    window[0, [0, 9, 10, 25]] = 0  # documents [0, 9), [9, 10), [10, 25), [25, 33)
    loss, _ = lm_loss(model, window, 0.0, separator=0)
    total = 0.0
    for start, stop in ((0, 9), (9, 10), (10, 25), (25, 32)):
        logits = model(window[:, start:stop]).logits[0]
        total += torch.nn.functional.cross_entropy(logits, window[0, start + 1:stop + 1],
                                                   reduction="sum")
    assert float(loss) == pytest.approx(float(total) / 32, rel=1e-6)  # the fused loss: fp32
    assert float(lm_loss(model, window, 0.0)[0]) != pytest.approx(float(loss), abs=1e-4)


def test_document_masked_pretraining_learns(corpus, tmp_path):
    out = tmp_path / "masked"
    summary = pretrain(build(run_config(corpus, out, max_steps=16, **{
        "data.document_mask": True, "precision.z_loss": 1e-4})))
    losses = step_losses(out)
    assert losses[16] < losses[1] - 1.0
    assert summary["val/loss"] < losses[1]


MOE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
       "n_experts": 4, "n_experts_per_token": 2, "moe_ffn_hidden_dim": 64}


def late_min_load(out) -> list[float]:
    """The least loaded expert's share × E over the last 10 of 40 steps (0: an expert of some
    layer that no token reached; 1: even)."""
    return [v for step, v in step_losses(out, "router/load_min").items() if step > 30]


def test_moe_pretraining_learns_and_every_expert_gets_tokens(corpus, tmp_path):
    """A Qwen3-MoE model from scratch: the loss falls and, at this run's high learning
    rate, each layer's router first crowds onto two of its four experts (the least loaded
    expert of some layer gets no token) and the balance loss, weighted 1, brings every
    expert of every layer back into use; the export is the family's checkpoint."""
    out = tmp_path / "moe"
    summary = pretrain(build(run_config(corpus, out, max_steps=40, **{
        "model.overrides": {**MOE, "family": "qwen3_moe", "router_aux_loss_coef": 1.0}})))
    losses = step_losses(out)
    assert losses[40] < losses[1] - 2.0
    for name in ("router/aux_loss", "router/load_max", "router/load_min"):
        assert sorted(step_losses(out, name)) == sorted(losses), name
    assert min(step_losses(out, "router/load_min").values()) < 0.05  # crowded at first
    assert min(late_min_load(out)) > 0.3
    assert all(v >= 1.0 for v in step_losses(out, "router/aux_loss").values())
    exported = load_checkpoint(out / "final")
    assert exported.config.family == "qwen3_moe" and exported.config.n_experts == 4
    assert summary["parameters"] == exported.config.num_params()


def test_aux_loss_free_balancing_brings_every_expert_back(corpus, tmp_path):
    """GLM-4.5's sigmoid router has no balance loss: unbalanced, each layer crowds onto two
    experts and stays there (an expert's share ~0.1 of even at the end); with DeepSeek-V3's
    selection-bias updates every expert of every layer is back in use while the loss falls,
    and the moved biases are in the export, which transformers' class computes with."""
    from transformers import AutoModelForCausalLM

    from lathe.pretrain.expert_balance import selection_biases

    def run(name: str, speed: float):
        out = tmp_path / name
        pretrain(build(run_config(corpus, out, max_steps=40, router_bias_update_speed=speed,
                                  **{"model.overrides": {**MOE, "family": "glm4_moe"}})))
        return out

    plain, balanced = run("plain", 0.0), run("balanced", 0.01)
    assert max(late_min_load(plain)) < 0.25
    # back by step 35 (step 31 sits near 0.4, either side by the last bits of the loss)
    assert min(late_min_load(balanced)[-5:]) > 0.4
    assert step_losses(balanced)[40] < step_losses(balanced)[1] - 2.0
    assert all(float(b.abs().max()) == 0 for b in selection_biases(
        load_checkpoint(plain / "final")))
    ours = load_checkpoint(balanced / "final")
    biases = selection_biases(ours)
    assert len(biases) == 2 and all(float(b.abs().max()) >= 0.1 for b in biases)
    theirs = AutoModelForCausalLM.from_pretrained(balanced / "final").eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_bias_balancing_of_a_model_without_a_selection_bias_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match="family='qwen3_moe' routes by softmax, with no "
                                          "selection bias to move"):
        pretrain(build(run_config(corpus, tmp_path / "r", router_bias_update_speed=0.01, **{
            "model.overrides": {**MOE, "family": "qwen3_moe"}})))
    with pytest.raises(ConfigError, match="router_bias_update_speed=-0.1 must be a number"):
        build(run_config(corpus, tmp_path / "r", router_bias_update_speed=-0.1))


def test_seq_len_longer_than_the_model_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match="data.seq_len=128 exceeds"):
        pretrain(build(run_config(corpus, tmp_path / "r", **{"data.seq_len": 128})))


@pytest.mark.slow
def test_wandb_logs_offline_without_an_api_key(corpus, tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    out = tmp_path / "run"
    pretrain(build(run_config(corpus, out, max_steps=4, **{
        "logging.report_to": "wandb", "logging.tags": ["test"]})))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (out / "wandb-run-id").is_file()


@pytest.mark.slow
def test_compiled_blocks_match_eager(corpus, tmp_path):
    pretrain(build(run_config(corpus, tmp_path / "eager", max_steps=3)))
    summary = pretrain(build(run_config(corpus, tmp_path / "compiled", max_steps=3, **{
        "precision.compile": True, "eval.sample_prompts": []})))
    assert summary["converters"] == {"compile": True}
    a, b = step_losses(tmp_path / "eager"), step_losses(tmp_path / "compiled")
    assert max(abs(a[s] - b[s]) for s in a) < 1e-4


def test_sampling_runs_the_compiled_blocks_eager(corpus):
    """Evaluation samples with a KV cache whose length grows each token: through compiled
    blocks that recompiled with symbolic shapes, which dynamo cannot trace through the
    Triton launchers (it crashed the first compiled run on an H100). It must not compile."""
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2,
                                    n_kv_heads=1, ffn_hidden_dim=64, max_seq_len=64))
    for layer in model.model.layers:
        layer.compile(backend=counting_backend)
    tokenizer = load_tokenizer(corpus / "tok")
    eager = sample_continuations(model, tokenizer, ["The"], 6, 64)
    assert graphs == []
    model(torch.ones(1, 8, dtype=torch.long))  # the blocks do compile outside sampling
    assert graphs
    assert eager[0][0] == "The" and eager[0][1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_and_fp8_on_gpu(corpus, tmp_path):
    """On a GPU: bf16 autocast, fused AdamW, and real FP8 matmuls where the GPU has them."""
    summary = pretrain(build(run_config(corpus, tmp_path / "gpu", max_steps=30, **{
        "precision.mixed_precision": "bf16", "precision.fp8": True})))
    losses = step_losses(tmp_path / "gpu")
    assert summary["parallel"]["device"].startswith("cuda")
    assert summary["parallel"]["mixed_precision"] == "bf16"
    assert summary["converters"]["fp8_emulated"] is (torch.cuda.get_device_capability() < (8, 9))
    assert losses[30] < losses[1] - 1.0


def test_both_entry_points_report_config_errors_in_one_line(corpus, tmp_path):
    import sys

    import yaml

    from lathe.core.cli import main

    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump(run_config(corpus, tmp_path / "out")))
    assert main(["pretrain", "--config", str(recipe), "--optim.lr=fast"]) == 2
    result = processes.run([sys.executable, "-m", "lathe.pretrain", "--config", str(recipe),
                            "--max_steps=0"], timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "lathe pretrain: error: the run length comes to 0 steps; it must be at least 1")


@pytest.mark.parametrize("kernels", ["0", "force"])
def test_fused_training_loss_equals_next_token_cross_entropy(kernels, monkeypatch):
    """lm_loss feeds the whole (B, T + 1) window with itself as labels so the head and loss
    can fuse; the extra last position must change nothing (causality)."""
    from lathe.pretrain.train import lm_loss
    from tests.builders import tiny_model
    model = tiny_model(n_layers=1)
    batch = torch.randint(0, 256, (3, 17))
    logits = model(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    monkeypatch.setenv("LATHE_KERNELS", kernels)
    loss, metrics = lm_loss(model, batch, z_loss=0.0)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert metrics == {"loss": loss}


def test_fp8_gemms_get_token_counts_divisible_by_16_and_the_loss_is_exact():
    """`torch._scaled_mm` needs M % 16 == 0; a (2, 17)-token batch has 34 rows. The padded
    layers must see multiples of 16 and give the unpadded layers' loss and gradients."""
    import contextlib

    from torch.overrides import TorchFunctionMode
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lathe.model import ModelConfig, Transformer
    from lathe.pretrain.runtime.converters import FP8_DIVISOR, convert_to_fp8, fp8_eligible

    config = ModelConfig.from_preset("tiny", vocab_size=256, dim=64, n_layers=1, n_heads=4,
                                     n_kv_heads=2, ffn_hidden_dim=128, max_seq_len=64)
    padded, plain = Transformer(config), Transformer(config)
    plain.load_state_dict(padded.state_dict())
    convert_to_fp8(padded, emulate=True)
    convert_to_float8_training(plain, module_filter_fn=fp8_eligible,
                               config=Float8LinearConfig(emulate=True))
    gemm_rows = []

    class RecordGemms(TorchFunctionMode):  # the matmuls torchao's FP8 linears run
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.mm, torch._scaled_mm):
                gemm_rows.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    batch = torch.randint(0, 256, (2, 17))
    losses = []
    for model in (padded, plain):
        with RecordGemms() if model is padded else contextlib.nullcontext():
            loss = model(batch, labels=batch).loss
        loss.backward()
        losses.append(loss)
    assert len(gemm_rows) >= 7, gemm_rows  # one per converted linear
    assert all(rows % FP8_DIVISOR == 0 for rows in gemm_rows), gemm_rows
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=0)
    for (name, a), (_, b) in zip(padded.named_parameters(), plain.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(("kernels", "fp8", "document_mask"), [
    ("force", False, False), ("force", True, False), ("0", False, False), ("0", True, False),
    ("force", False, True)])
def test_pretraining_in_bf16(corpus, tmp_path, monkeypatch, kernels, fp8, document_mask):
    """The GPU's numerics on CPU: bf16 autocast, every Triton kernel (interpreted) or none,
    eval with sample continuations through the KV cache, a checkpoint and the bf16 export;
    document masking through the attention kernel's document path."""
    monkeypatch.setenv("LATHE_KERNELS", kernels)
    out = tmp_path / "bf16"
    summary = pretrain(build(run_config(corpus, out, max_steps=2, micro_batch_size=2, **{
        "precision.mixed_precision": "bf16", "precision.fp8": fp8,
        "data.document_mask": document_mask,
        "model.overrides": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                            "ffn_hidden_dim": 64, "max_seq_len": 32},
        "data.seq_len": 15, "eval.every": 2, "eval.batches": 1, "checkpoint.every": 2})))
    assert summary["parallel"]["mixed_precision"] == "bf16"
    assert summary["converters"].get("fp8_layers", 0) == (7 if fp8 else 0)
    assert all(map(math.isfinite, step_losses(out).values()))
    assert load_checkpoint(out / "final").model.embed_tokens.weight.dtype == torch.bfloat16


def test_only_the_tied_lm_head_notice_is_filtered():
    def notice(names: str) -> logging.LogRecord:
        return logging.LogRecord("accelerate.utils.other", logging.WARNING, __file__, 1,
                                 f"[RANK 0] Removed shared tensor {names} while saving. "
                                 "This should be OK, but check ...", None, None)

    assert not _no_tied_head_notice(notice("{'lm_head.weight'}"))
    assert not _no_tied_head_notice(notice("{'module.lm_head.weight'}"))
    assert _no_tied_head_notice(notice("{'lm_head.weight', 'layers.0.mlp.up.weight'}"))
    assert _no_tied_head_notice(notice("{'layers.0.mlp.up.weight'}"))


def test_regional_compile_builds_one_graph_for_every_block_under_fp8_and_checkpointing():
    """Each block's compiled forward serves every block: FP8 padding and activation
    checkpointing wrap the forward through the block's class, not each instance. A forward
    set per instance made dynamo guard on it and recompile per block (past its limit of 8,
    the rest of a 1B model ran eagerly: FP8 at half bf16's speed on an H200), and with
    checkpointing nothing was compiled at all. Parameter names stay HF's."""
    from torch._dynamo.utils import counters

    from lathe.model import ModelConfig, Transformer
    from lathe.pretrain.runtime.converters import (
        compile_blocks,
        convert_to_fp8,
        enable_activation_checkpointing,
    )

    config = ModelConfig.from_preset("tiny", vocab_size=256, dim=64, n_layers=3, n_heads=4,
                                     n_kv_heads=2, ffn_hidden_dim=128, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(config).train()
    names = [name for name, _ in model.named_parameters()]
    reference = copy.deepcopy(model)
    convert_to_fp8(model, emulate=True)
    convert_to_fp8(reference, emulate=True)
    enable_activation_checkpointing(model)
    compile_blocks(model)
    assert [name for name, _ in model.named_parameters()] == names
    batch = torch.randint(0, 256, (2, 17))
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss = model(batch, labels=batch).loss
    loss.backward()
    assert counters["frames"]["ok"] == 1 and counters["stats"]["unique_graphs"] == 1
    expected = reference(batch, labels=batch).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
