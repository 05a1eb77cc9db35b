"""A request's constraint compiled first in a child process, so that no grammar can take the
server down.

llguidance builds a matcher in native code, and some inputs under every size limit crash
it outright: a Lark grammar of a few thousand chained rules, a JSON schema chaining a
thousand `$ref`s, tool parameters chaining `$anchor`s (SIGSEGV in `LLMatcher`'s
construction — the whole front end, and the engine core with it). Before a constraint is
compiled in the server's processes, `GrammarChecker.check` compiles it here, in a child
that imports only llguidance, over the same tokenizer and limits: a crash, a compile past
`seconds` or past `memory_bytes` costs that request a 400 and the child a restart. The
compile is deterministic, so what passed here compiles the same in the server.

llguidance builds its lexer lazily, at the first token mask, which the engine core computes
inside a step: `(a{1000}){1000}` took 2 s there, and every request in the batch waited. The
child computes that first mask too, and a constraint whose first mask takes more than
`mask_seconds` is refused.

Only a constraint new to the server is checked: `Constraints` keeps what it compiled.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from lathe.core.worker_pool import WorkerError, WorkerPool, WorkerTimeout, limit_memory, serve_lines

# what one compile and one step may cost the matcher (llguidance's units: ~50k fuel/ms at
# build, ~14k/ms per step; its defaults are 1M and 200k)
LIMITS = dict(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, max_grammar_size=500_000,
              verbose_errors=False)
CHECK_SECONDS = 5.0
MASK_SECONDS = 0.5  # the most a constraint's first token mask may hold up an engine step
MEMORY_BYTES = 2 << 30


class GrammarRefused(ValueError):
    """The constraint does not compile, or compiling it crashed or ran past its limits."""


class GrammarChecker:
    """Compiles a grammar in a child process and says whether it compiles (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 seconds: float = CHECK_SECONDS, memory_bytes: int = MEMORY_BYTES,
                 processes: int = 2, mask_seconds: float = MASK_SECONDS) -> None:
        self.seconds, self.memory_bytes = seconds, memory_bytes
        self.pool = WorkerPool("lathe.serve.grammar_check", [str(memory_bytes)],
                               {"tokenizer": tokenizer_json, "vocab_size": vocab_size,
                                "eos_token_ids": sorted(eos_token_ids),
                                "mask_seconds": mask_seconds}, processes,
                               start_seconds=60.0)  # a large vocabulary takes a while

    def check(self, grammar: str) -> None:
        """Return when `grammar` (llguidance's text of it) compiles; `GrammarRefused` with
        the reason otherwise."""
        try:
            answer = self.pool.call({"grammar": grammar}, self.seconds, 1 << 16)
        except WorkerTimeout:
            raise GrammarRefused(f"compiling it took more than {self.seconds:g} s or "
                                 f"{self.memory_bytes >> 20} MiB; it was stopped") from None
        except WorkerError as error:
            raise GrammarRefused(f"it crashed the grammar compiler ({error}); simplify it "
                                 "(fewer nested or chained rules and references)") from None
        if "error" in answer:
            raise GrammarRefused(answer["error"])

    def close(self) -> None:
        self.pool.close()


def _setup(message: dict[str, Any]) -> dict[str, Any]:
    from llguidance import LLParserLimits, LLTokenizer

    return {"tokenizer": LLTokenizer(message["tokenizer"], n_vocab=message["vocab_size"],
                                     eos_token=message["eos_token_ids"]),
            "limits": LLParserLimits(**LIMITS), "mask_seconds": message["mask_seconds"]}


def _check(state: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    from llguidance import LLMatcher

    matcher = LLMatcher(state["tokenizer"], request["grammar"], log_level=0,
                        limits=state["limits"])
    if not matcher.is_error():
        start = time.perf_counter()
        matcher.compute_bitmask()
        took = time.perf_counter() - start
        if took > state["mask_seconds"]:
            return {"error": f"its first token mask took {took:.2f} s, more than "
                             f"{state['mask_seconds']:g} s: every request in the batch would "
                             "wait for it; simplify it (fewer or smaller repetitions)"}
    return {"error": matcher.get_error()} if matcher.is_error() else {"ok": True}


if __name__ == "__main__":
    limit_memory(int(sys.argv[1]))
    serve_lines(_setup, _check)
