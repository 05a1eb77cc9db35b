"""A request's sampling parameters — OpenAI's names and vLLM's extras — and the ranges
each must lie in, checked when they are built. No torch here: a server's front end builds
and checks them; the engine core draws with them (`lathe.serve.sampling`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lathe.serve.structured import StructuredOutput


class SamplingError(ValueError):
    """A sampling parameter outside its allowed range (the message names field and range)."""


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(name: str, value: object, allowed: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise SamplingError(f"{name}={shown} must be {allowed}")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_STOP, MAX_STOP_CHARS = 16, 256  # stop matching runs per generated token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 256  # token sequences a request bans, each at most MAX_BAD_WORD_TOKENS
MAX_BAD_WORD_TOKENS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_LOGPROBS = 20
# Below this a temperature means greedy, as in vLLM: dividing logits by 1e-40 overflows
# them to inf, and their softmax is NaN.
TEMPERATURE_EPSILON = 1e-5


@dataclass(frozen=True)
class Bound:
    """The range a numeric parameter must lie in (`low_open`: the low end is excluded)."""

    low: float
    high: float
    low_open: bool = False

    def holds(self, value: float) -> bool:
        # NaN compares false both ways, so it never holds
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def __str__(self) -> str:
        low, high = (int(v) if float(v).is_integer() else v for v in (self.low, self.high))
        return f"in {'(' if self.low_open else '['}{low}, {high}]"


# Every numeric request parameter and the range an engine tensor can hold and a user could
# mean (vLLM's limits); the server's request schema and `SamplingParams` both check these.
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, INT32_MAX),
    "min_tokens": Bound(0, INT32_MAX),
    "temperature": Bound(0, 2),
    "top_p": Bound(0, 1, low_open=True),
    "top_k": Bound(-1, INT32_MAX),  # -1 or 0: off
    "min_p": Bound(0, 1),
    "repetition_penalty": Bound(0, 2, low_open=True),
    "presence_penalty": Bound(-2, 2),
    "frequency_penalty": Bound(-2, 2),
    "seed": Bound(INT64_MIN, INT64_MAX),
    "n": Bound(1, 16),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS),
    "logit_bias": Bound(-100, 100),  # each bias; the token ids are checked as token ids
    "token_id": Bound(0, INT32_MAX),  # any token id a request names
}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-N log-probabilities per generated token
    # log-probs of softmax(logits / temperature), the distribution top-k/p then cut and a
    # trainer recomputes (GRPO), rather than the model's own (OpenAI's and vLLM's default)
    logprobs_at_temperature: bool = False
    prompt_logprobs: int | None = None  # top-N log-probabilities per prompt token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logits
    structured: StructuredOutput | None = None  # what the output must match
    min_tokens: int = 0  # EOS, stop tokens and stop strings are held off until this many
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences banned
    allowed_token_ids: list[int] | None = None  # None: all; else only these may be drawn
    include_stop_str_in_output: bool = False  # a matched stop string ends the text
    skip_special_tokens: bool = True  # special tokens left out of the text
    # what min_tokens holds back: the engine's EOS ids and stop_token_ids (the engine fills it)
    min_tokens_stop_ids: tuple[int, ...] = ()
    # the prompt is scored (completions' echo with max_tokens=0): the one token drawn is
    # dropped, and since it is never fed back it needs no position or KV slot
    score_only: bool = False

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name, None)
            if name in ("logit_bias", "token_id") or value is None:
                continue
            if not is_number(value) or not bound.holds(value):
                _refuse(name, value, str(bound))
        token_id = BOUNDS["token_id"]
        if not (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
                is_number(t) and token_id.holds(t) for t in self.stop_token_ids)):
            _refuse("stop_token_ids", self.stop_token_ids,
                    f"at most {MAX_STOP_TOKEN_IDS} token ids, each {token_id}")
        if not (len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
                is_number(t) and token_id.holds(t)
                and is_number(v) and BOUNDS["logit_bias"].holds(v)
                for t, v in self.logit_bias.items())):
            _refuse("logit_bias", self.logit_bias,
                    f"a map of at most {MAX_LOGIT_BIAS} token ids to a bias "
                    f"{BOUNDS['logit_bias']}")
        if self.score_only and self.max_tokens != 1:
            _refuse("max_tokens", self.max_tokens, "1 when only the prompt is scored "
                    "(score_only: the one token drawn is dropped)")
        if self.min_tokens > self.max_tokens:
            _refuse("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        if not (len(self.bad_words_ids) <= MAX_BAD_WORDS and all(
                isinstance(ids, list) and 0 < len(ids) <= MAX_BAD_WORD_TOKENS
                and all(is_number(t) and token_id.holds(t) for t in ids)
                for ids in self.bad_words_ids)):
            _refuse("bad_words", self.bad_words_ids,
                    f"at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_TOKENS} tokens each")
        if self.allowed_token_ids is not None and not (
                0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                and all(is_number(t) and token_id.holds(t) for t in self.allowed_token_ids)):
            _refuse("allowed_token_ids", self.allowed_token_ids,
                    f"1 to {MAX_ALLOWED_TOKEN_IDS} token ids, each {token_id}")
        if not (len(self.stop) <= MAX_STOP and all(
                isinstance(text, str) and len(text) <= MAX_STOP_CHARS for text in self.stop)):
            _refuse("stop", self.stop,
                    f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
        if self.temperature < TEMPERATURE_EPSILON:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether penalties, a logit bias or banned tokens change the logits before
        sampling (and so depend on the tokens drawn so far)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.min_tokens
                    or self.bad_words_ids or self.allowed_token_ids is not None)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: the argmax of the whole batch can stand in for it."""
        return self.greedy and not self.penalized
