"""Optimizers: AdamW with weight decay on matrices only, or Muon for the hidden matrices.

Parameter roles are read from names, which mirror HF Llama's: embeddings and the LM head
are matrices that Muon must not orthogonalize (their rows are per-token, not a linear map
of the hidden state), so Muon takes only the decoder layers' 2-D weights and AdamW the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from lathe.core.errors import ConfigError
from lathe.pretrain.runtime.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (decayed) and vectors such as norm weights (not)."""
    decay, no_decay = [], []
    for param in _trainable(model):
        # a weight ZeRO-3 partitioned as it was built holds a flat slice; ds_shape is its own
        (decay if len(getattr(param, "ds_shape", param.shape)) >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizers(model: nn.Module, config: OptimConfig,
                     device_type: str) -> list[torch.optim.Optimizer]:
    """One AdamW, or [Muon for hidden matrices, AdamW for the rest]."""
    adamw_kwargs = dict(lr=config.lr, betas=config.betas, eps=config.eps,
                        fused=device_type == "cuda")
    if config.name == "adamw":
        return [torch.optim.AdamW(param_groups(model, config.weight_decay), **adamw_kwargs)]
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"optim.name=muon needs torch.optim.Muon (torch >= 2.9); this is "
                          f"torch {torch.__version__}; use optim.name=adamw")
    hidden = {id(p) for name, p in model.named_parameters()
              if p.requires_grad and p.ndim == 2 and ".layers." in f".{name}"}
    rest = [p for p in _trainable(model) if id(p) not in hidden]
    muon = torch.optim.Muon([p for p in _trainable(model) if id(p) in hidden],
                            lr=config.lr, weight_decay=config.weight_decay,
                            momentum=config.muon_momentum, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(
        [{"params": [p for p in rest if p.ndim >= 2], "weight_decay": config.weight_decay},
         {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
        **adamw_kwargs)
    return [muon, adamw]


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters (`parameters()` yields a tied matrix once)."""
    return [p for p in model.parameters() if p.requires_grad]
