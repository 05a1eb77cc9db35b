"""What a student's loss against a teacher is: the divergence between their next-token
distributions per token (forward KL, reverse KL, generalized JSD at a temperature), and
the head op that mixes it with cross-entropy a chunk of rows at a time, so that neither
model's full-vocabulary logits are held (logit and on-policy distillation)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lathe.core.errors import ConfigError
from lathe.kernels.fused_ce import labelled_rows, linear_reduce
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.config import DistillConfig
from lathe.pretrain.runtime.trainer import Runtime


def kd_per_token(student_logits: Tensor, teacher_logits: Tensor, kind: str = "forward_kl",
                 temperature: float = 1.0, beta: float = 0.5) -> Tensor:
    """The divergence between teacher and student at each row of (..., V) logits, at
    `temperature` and scaled by T² (Hinton et al.)."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if kind == "forward_kl":  # KL(teacher ‖ student): mode-covering
        per_token = (t.exp() * (t - s)).sum(-1)
    elif kind == "reverse_kl":  # KL(student ‖ teacher): mode-seeking
        per_token = (s.exp() * (s - t)).sum(-1)
    elif kind == "jsd":  # β·KL(t ‖ m) + (1 − β)·KL(s ‖ m), m = β·t + (1 − β)·s
        m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)
        per_token = (beta * (t.exp() * (t - m)).sum(-1)
                     + (1 - beta) * (s.exp() * (s - m)).sum(-1))
    else:
        raise ConfigError(f"loss={kind!r}: choose forward_kl, reverse_kl or jsd")
    return per_token * temperature**2


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
            kind: str = "forward_kl", temperature: float = 1.0,
            beta: float = 0.5) -> Tensor:
    """Per-token divergence (`kd_per_token`) averaged over masked positions. (N, T, V)
    logits, (N, T) mask."""
    mask = mask.float()
    per_token = kd_per_token(student_logits, teacher_logits, kind, temperature, beta)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


TeacherRows = Callable[[slice | Tensor], Tensor]


def teacher_rows(runtime: Runtime, teacher: nn.Module, ids: Tensor,
                 documents: Tensor | None = None) -> TeacherRows:
    """The teacher's logits for a slice (or the indices) of the batch's scored positions
    (position t of row b is b·(T − 1) + t). Its forward runs now; the logits of each slice
    are made when asked for, from the final hidden states, through its head module (whose
    call gathers a ZeRO-3-partitioned weight for itself)."""
    with torch.no_grad(), runtime.autocast():
        hidden = teacher(ids, documents=documents, head=False).hidden[:, :-1].flatten(0, 1)
    head = runtime.accelerator.unwrap_model(teacher)

    def rows_logits(rows: slice | Tensor) -> Tensor:
        with torch.no_grad(), runtime.autocast():
            return head.compute_logits(hidden[rows])
    return rows_logits


@dataclass
class DistillationLoss:
    """The student's loss on a (B, T) batch as a head op: `ce_weight` · cross-entropy +
    (1 − `ce_weight`) · divergence from the teacher, both averaged over the labelled
    positions, a chunk of rows at a time (neither model's (B, T, vocab) logits are held on
    the chunked path). With `advantages` ((B,), on-policy samples scored by a reward, less
    a baseline) it adds `reward_weight` · REINFORCE: each labelled token's −log p at the
    sampling temperature times its row's advantage, averaged alike. After a call, `parts`
    holds the terms."""

    labels: Tensor
    teacher: TeacherRows
    config: DistillConfig
    advantages: Tensor | None = None
    parts: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def chunked(self, hidden: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
        """Through the head for the labelled positions only (`labelled_rows`): a chat's
        prompt is most of its rows and adds nothing to either term."""
        scored, rows_loss = hidden[:, :-1].flatten(0, 1), self._rows()
        keep = labelled_rows(self.labels[:, 1:].flatten())
        if keep is None:
            return linear_reduce(scored, weight, rows_loss, softcap=softcap)
        return linear_reduce(scored.index_select(0, keep), weight,
                             lambda logits, rows: rows_loss(logits, keep[rows]), softcap=softcap)

    def from_logits(self, logits: Tensor) -> Tensor:
        scored = logits[:, :-1].flatten(0, 1).float()
        return self._rows()(scored, slice(0, scored.shape[0])).sum()

    def _rows(self) -> Callable[[Tensor, slice | Tensor], Tensor]:
        """The loss of a chunk's logits, for the scored positions `rows` (a slice of them,
        or their indices)."""
        targets = self.labels[:, 1:].flatten()
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        sums = torch.zeros(3, device=targets.device)
        c = self.config
        per_row = self.labels.shape[1] - 1
        self.parts = {}

        def rows_loss(logits: Tensor, rows: slice | Tensor) -> Tensor:
            mask, target = valid[rows], targets[rows].clamp(min=0)[:, None]
            ce = (torch.logsumexp(logits, -1) - logits.gather(1, target)[:, 0]) * mask
            kd = kd_per_token(logits, self.teacher(rows), c.loss, c.temperature,
                              c.jsd_beta) * mask
            loss = c.ce_weight * ce + (1 - c.ce_weight) * kd
            pg = torch.zeros_like(ce)
            if self.advantages is not None:
                scaled = logits / c.temperature
                position = torch.arange(targets.shape[0], device=logits.device)[rows]
                pg = (torch.logsumexp(scaled, -1) - scaled.gather(1, target)[:, 0]) * mask \
                    * self.advantages[position // per_row]
                loss = loss + c.reward_weight * pg
            sums.add_(torch.stack([ce.sum(), kd.sum(), pg.sum()]).detach())
            self.parts = {"ce": sums[0] / count, "kd": sums[1] / count,
                          **({"pg": sums[2] / count} if self.advantages is not None else {})}
            return loss / count
        return rows_loss


def check_vocabularies(student: nn.Module, teacher: nn.Module) -> None:
    """The teacher's logits must cover the student's tokens, index for index."""
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ConfigError(f"teacher vocab_size {teacher.config.vocab_size} != student "
                          f"{student.config.vocab_size}: logits must cover the same tokens")
