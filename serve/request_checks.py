"""What a request must fit to be served by one engine — its vocabulary, context length, KV
cache and tokenizer — checked once, at the door: by the server's front end before a request
crosses to the engine core's process, or by `LLMEngine.add_request` in one process — and the
errors a request or an adapter fails with. No torch here: the front end checks requests
without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lathe.serve.block_manager import blocks_for

if TYPE_CHECKING:
    from lathe.serve.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot serve as given (the message names field and limit)."""


class AdapterError(ValueError):
    """An adapter request the engine refuses (unknown name, no free slot, a bad folder)."""


@dataclass(frozen=True)
class RequestLimits:
    """What every request must fit to be served by one engine: its vocabulary, context
    length, KV cache and tokenizer. Checked by the engine and, before a request crosses to
    the engine core's process, by the server's front end (`lathe.serve.async_engine`)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    has_tokenizer: bool

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestError` for a request that could never complete (a structured
        output's grammar is checked by whoever holds the `Constraints`)."""
        vocab = self.vocab_size
        if not prompt_ids:
            raise RequestError("prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab})")
        total = len(prompt_ids) + params.max_tokens - params.score_only
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens} "
                f"({total} in all); shorten the prompt or lower max_tokens")
        blocks = blocks_for(total, self.block_size)
        if blocks > self.num_blocks:
            raise RequestError(f"prompt + max_tokens = {total} tokens need {blocks} KV blocks but "
                               f"the cache has {self.num_blocks}; lower max_tokens "
                               "or give the engine a larger KV budget")
        if params.stop and not self.has_tokenizer:
            raise RequestError("stop strings need a tokenizer; this checkpoint has none "
                               "(use stop_token_ids)")
        for name, ids in (("logit_bias", list(params.logit_bias)),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("bad_words", [t for word in params.bad_words_ids for t in word])):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise RequestError(f"{name} token ids {outside[:5]} are outside the "
                                   f"vocabulary [0, {vocab})")
        if params.structured is not None and params.ignore_eos:
            raise RequestError("ignore_eos cannot be combined with a structured output, "
                               "which ends at EOS once complete")
