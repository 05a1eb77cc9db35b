"""Linear (LM head) + cross-entropy without materializing the (tokens × vocab) logits:
the tokens are processed in chunks; for each chunk a Triton kernel turns the chunk's
logits into its loss and, in place, into the gradient softmax − one-hot (two passes over
the vocabulary with an online log-sum-exp, fp32), and the gradients of the hidden states
and the weight are accumulated right away. The backward only scales them. Peak memory is
one chunk of logits instead of all of them (Liger's FusedLinearCrossEntropy idea).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.dispatch import use_triton

IGNORE_INDEX = -100


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, labels: Tensor,
                                   ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy of (N, D) hidden states through the (V, D) head over valid labels."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=ignore_index)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                         ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean next-token loss of (N, D) hidden states through the LM head (chunked Triton on
    CUDA; the plain logits-then-cross-entropy reference elsewhere)."""
    if use_triton("linear_cross_entropy", hidden):
        from lathe.kernels.fused_ce_triton import linear_cross_entropy_triton
        return linear_cross_entropy_triton(hidden, weight, labels, ignore_index)
    return linear_cross_entropy_reference(hidden, weight, labels, ignore_index)
