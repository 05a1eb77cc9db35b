"""One generated completion as the scheduler and engine see it: its tokens, its blocks,
how much of it has KV computed, and how it ends.

A request with n > 1 becomes n sequences; all but the first wait for the first one's
prompt to be computed, then find its full blocks in the prefix cache instead of
recomputing them.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lathe.serve.block_manager import NO_HASH, BlockTable
from lathe.serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    parent: Sequence | None = None  # admitted only once the parent's prompt is computed
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # [None, logprob of prompt token 1, ...] while a request's prompt log-probs are scored
    prompt_logprobs: list | None = None
    adapter: str | None = None  # the LoRA adapter it runs on (None: the base alone)
    adapter_slot: int = -1  # that adapter's slot in the engine
    cache_root: int = NO_HASH  # its prefix-cache chain's root: its adapter's own
    # the engine's weights it runs on (`LLMEngine.weight_version`: updates wait for an idle
    # engine, so a sequence never mixes two)
    weight_version: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without building the whole list."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.output_ids[start - split:end - split]
        if end <= split:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - split]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV this sequence still needs (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed >= len(self.prompt_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """A sequence scoring its prompt must compute every prompt position itself."""
        return self.prompt_logprobs is None

    @property
    def ready(self) -> bool:
        """Whether the scheduler may admit it (n > 1 siblings wait for the shared prompt)."""
        parent = self.parent
        return parent is None or parent.prompt_computed or parent.status is Status.FINISHED


def request_sequences(request_id: str, prompt_ids: list[int], params: SamplingParams,
                      generator: Callable[[int], torch.Generator | None],
                      eos_token_ids: set[int], weight_version: int) -> list[Sequence]:
    """The `params.n` sequences of one request, siblings waiting on the first's prompt:
    `generator(index)` seeds each one's draws, and `min_tokens` learns which ids it holds back
    (the engine's EOS ids and the request's stop ids)."""
    if params.min_tokens:
        params = dataclasses.replace(params, min_tokens_stop_ids=tuple(sorted(
            eos_token_ids | set(params.stop_token_ids))))
    seqs: list[Sequence] = []
    for index in range(params.n):
        seq = Sequence(request_id, index, list(prompt_ids), params, generator(index),
                       parent=seqs[0] if seqs else None, weight_version=weight_version)
        if index == 0 and params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        seqs.append(seq)
    return seqs
