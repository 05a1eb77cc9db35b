"""Typed config of pretraining: the runtime's `TrainConfig` plus the model (a preset and
overrides) and the token shards it trains on. Defaults are the tiny CPU run."""

from __future__ import annotations

from dataclasses import dataclass, field

from lathe.core.errors import ConfigError
from lathe.model.config import ModelConfig
from lathe.pretrain.runtime.config import TrainConfig


@dataclass
class ModelSection:
    """A preset plus field overrides; vocab_size follows the tokenizer unless given."""

    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)

    def build(self, vocab_size: int) -> ModelConfig:
        return ModelConfig.from_preset(self.preset, **{"vocab_size": vocab_size,
                                                       **self.overrides})


@dataclass
class DataSection:
    """Token shards written by `lathe shards`, and the tokenizer they were made with."""

    shards: str = "runs/e2e/shards"
    tokenizer: str = "runs/e2e/tokenizer"
    seq_len: int = 128
    # attend within each document of a window only (documents start at the shards' BOS),
    # positions restarting at each, as torchtitan's document masking; off, a window is one
    # sequence across its documents, as GPT-2 trained
    document_mask: bool = False


@dataclass
class PretrainConfig(TrainConfig):
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    # a sigmoid router's aux-loss-free balancing (DeepSeek-V3's γ, 0.001 there): how far
    # each step moves an over- or under-loaded expert's selection bias; 0 leaves it alone
    router_bias_update_speed: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        speed = self.router_bias_update_speed
        if not isinstance(speed, (int, float)) or isinstance(speed, bool) \
                or not 0 <= speed < float("inf"):
            raise ConfigError(f"router_bias_update_speed={speed!r} must be a number >= 0 "
                              "(DeepSeek-V3 used 0.001)")
