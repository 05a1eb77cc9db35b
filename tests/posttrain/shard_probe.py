"""Run by `test_sharding` under `accelerate launch` (2 CPU processes): load a policy and a
frozen reference from a checkpoint and prepare them the way the post-training stages do, and
write, per rank, whether it built them holding whole weights (not a skeleton the main process
sends the weights to, nor partitioned as built), what fraction of a weight each holds
locally, how far the (sharded) reference's logits are from the unsharded model's (from its
forward, and made from its hidden states after it), whether the policy's loss went through
the chunked head (no logits made) to its value, and the rank's peak resident memory once
both are prepared (before the probe loads a whole copy to compare with)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
from torch import nn

from lathe.core.cli import exit_process
from lathe.model.checkpoint import OpenCheckpoint, load_checkpoint
from lathe.posttrain.common import stage_model
from lathe.pretrain.runtime.config import LoggingConfig, TrainConfig
from lathe.pretrain.runtime.trainer import Runtime

WEIGHT = "model.layers.0.mlp.gate_proj.weight"


def local_fraction(module: nn.Module) -> float:
    """This rank's share of WEIGHT: a ZeRO-3 partition, an FSDP2 DTensor shard, or all."""
    param = next(p for name, p in module.named_parameters() if name.endswith(WEIGHT))
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor.numel() / param.ds_numel
    if hasattr(param, "to_local"):
        return param.to_local().numel() / param.numel()
    return 1.0


def main(checkpoint: Path, out: Path) -> None:
    config = TrainConfig(out_dir=str(out), max_steps=1,
                         logging=LoggingConfig(report_to="none", progress=False))
    runtime = Runtime(config, stage="probe")
    opened = OpenCheckpoint(checkpoint)
    policy, reference = stage_model(runtime, opened).train(), stage_model(runtime, opened)
    whole_weights = any(not p.is_meta and 0 < p.numel() == getattr(p, "ds_numel", p.numel())
                        for p in (*policy.parameters(), *reference.parameters()))
    runtime.prepare(policy, total_steps=1)
    frozen = runtime.prepare_frozen(reference)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    whole = load_checkpoint(checkpoint)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = whole(ids).logits
        loss = whole(ids, labels=ids).loss
    ids = ids.to(runtime.device)
    with torch.no_grad(), runtime.autocast():
        got = frozen(ids).logits.float().cpu()
        chunked = runtime.model(ids, labels=ids, return_logits=False)
        hidden = frozen(ids, head=False).hidden  # a teacher's rows, made after its forward
        rows = runtime.accelerator.unwrap_model(frozen).compute_logits(hidden[:, 5:]).cpu()
    report = {"setup": runtime.setup, "whole_weights": whole_weights,
              "policy": local_fraction(runtime.model),
              "reference": local_fraction(frozen),
              "reference_trainable": sum(p.requires_grad for p in frozen.parameters()),
              "reference_logits_error": (got - expected).abs().max().item(),
              "rows_logits_error": (rows - expected[:, 5:]).abs().max().item(),
              "chunked_loss_error": abs(chunked.loss.item() - loss.item()),
              "logits_made": chunked.logits is not None, "peak_rss_gib": peak_rss / 2**30}
    (out / f"rank{runtime.rank}.json").write_text(json.dumps(report))
    runtime.accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    exit_process(0)
