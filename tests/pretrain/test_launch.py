"""Launch recipes: every accelerate YAML in recipes/accelerate turns into the plugin it
names, the runtime knows what each asks for, and a mismatch is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate import Accelerator
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import (
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)

from lathe.pretrain.runtime.launch import (
    Launch,
    LaunchError,
    check_launch,
    describe,
    needs_cpu_bridge,
    requested_launch,
)

RECIPES = Path(__file__).parents[2] / "recipes" / "accelerate"

# recipe -> (distributed type, processes, FSDP version or ZeRO stage, optimizer offload)
EXPECTED = {
    "cpu": (DistributedType.NO, 1, None, None),
    "cpu-ddp": (DistributedType.MULTI_CPU, 2, None, None),
    "cpu-fsdp2": (DistributedType.FSDP, 2, 2, None),
    "cpu-zero1": (DistributedType.DEEPSPEED, 2, 1, "none"),
    "cpu-zero2": (DistributedType.DEEPSPEED, 2, 2, "none"),
    "cpu-zero3": (DistributedType.DEEPSPEED, 2, 3, "none"),
    "gpu": (DistributedType.NO, 1, None, None),
    "8gpu-fsdp2": (DistributedType.FSDP, 8, 2, None),
    "8gpu-zero2": (DistributedType.DEEPSPEED, 8, 2, "none"),
    "8gpu-zero3": (DistributedType.DEEPSPEED, 8, 3, "none"),
    "8gpu-zero3-offload": (DistributedType.DEEPSPEED, 8, 3, "cpu"),
    "multinode-fsdp2": (DistributedType.FSDP, 16, 2, None),
}


def launch_env(path: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file path` gives each process."""
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    env["WORLD_SIZE"] = str(args.num_processes)  # what torchrun adds per process
    return dict(env)


def test_every_recipe_is_covered():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_becomes_its_plugin(name, monkeypatch):
    kind, processes, level, offload = EXPECTED[name]
    env = launch_env(RECIPES / f"{name}.yaml")
    on_gpu = not name.startswith("cpu")
    assert requested_launch(env, cuda=on_gpu) == Launch(kind, processes)
    assert needs_cpu_bridge(Launch(kind, processes), cuda=True) is False
    assert env.get("ACCELERATE_MIXED_PRECISION") == ("bf16" if on_gpu else "no")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if kind is DistributedType.FSDP:
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == level
        assert plugin.transformer_cls_names_to_wrap == ["DecoderLayer"]
        assert plugin.reshard_after_forward is True
    if kind is DistributedType.DEEPSPEED:
        plugin = DeepSpeedPlugin()
        zero = plugin.deepspeed_config["zero_optimization"]
        assert zero["stage"] == level
        assert zero.get("offload_optimizer", {}).get("device", "none") == offload
        if level == 3:
            assert zero["stage3_gather_16bit_weights_on_model_save"] is True


def test_requested_launch_reads_the_launcher_environment():
    assert requested_launch({}, cuda=False) == Launch(DistributedType.NO, 1)
    assert requested_launch({"WORLD_SIZE": "2"}, cuda=False).distributed_type is \
        DistributedType.MULTI_CPU
    assert requested_launch({"WORLD_SIZE": "4"}, cuda=True).distributed_type is \
        DistributedType.MULTI_GPU
    assert needs_cpu_bridge(Launch(DistributedType.FSDP, 2), cuda=False)
    assert not needs_cpu_bridge(Launch(DistributedType.NO, 1), cuda=False)


def test_a_silent_fallback_is_refused():
    accelerator = Accelerator(cpu=True)
    assert describe(accelerator)["distributed_type"] == "NO"
    check_launch(accelerator, Launch(DistributedType.NO, 1))
    with pytest.raises(LaunchError, match="asked for FSDP on 2 process.*set up NO on 1"):
        check_launch(accelerator, Launch(DistributedType.FSDP, 2))
