"""No constraint can take the server down: grammars that crash llguidance's native compile
(SIGSEGV on a few thousand chained Lark rules or a thousand chained `$ref`s, each under the
64 KiB limit) are compiled first in a child process, answered 400, and the server — both
of its processes — goes on serving."""

from __future__ import annotations

import json

import httpx
import pytest
from llguidance import LLMatcher
from tokenizers import Tokenizer

from lathe.serve.grammar_check import GrammarChecker, GrammarRefused
from lathe.serve.structured import MAX_SPEC_CHARS
from tests.serve.test_connections import serve_process


def chained_rules(n: int) -> str:
    """A Lark grammar of `n` rules, each naming the next (3,000: SIGSEGV in llguidance)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def chained_refs(n: int) -> str:
    """A JSON schema (compact JSON) whose items chain `n` `$ref`s (1,200: SIGSEGV)."""
    defs = {f"d{i}": {"items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    return json.dumps({"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"},
                      separators=(",", ":"))


@pytest.fixture(scope="module")
def checker(checkpoint):
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    checker = GrammarChecker(tokenizer.to_str(), tokenizer.get_vocab_size(True), [1],
                             seconds=10)
    yield checker
    checker.close()


def test_grammars_that_crash_the_compiler_are_refused_and_the_checker_recovers(checker):
    assert len(chained_rules(3000)) < MAX_SPEC_CHARS
    assert len(chained_refs(1200)) < MAX_SPEC_CHARS
    for grammar in (LLMatcher.grammar_from_lark(chained_rules(3000)),
                    LLMatcher.grammar_from_json_schema(chained_refs(1200))):
        with pytest.raises(GrammarRefused, match="crashed the grammar compiler"):
            checker.check(grammar)
        checker.check(LLMatcher.grammar_from_lark('start: "yes" | "no"'))  # a new child
    with pytest.raises(GrammarRefused, match="unknown name"):
        checker.check(LLMatcher.grammar_from_lark("start: missing"))
    with pytest.raises(GrammarRefused, match="its first token mask took .* every request"):
        checker.check(LLMatcher.grammar_from_regex("(a{1000}){1000}"))  # 2 s in a step
    checker.check(LLMatcher.grammar_from_lark(chained_rules(100)))


@pytest.mark.slow
def test_a_server_answers_400_to_a_crashing_grammar_and_keeps_serving(checkpoint):
    process, url = serve_process(checkpoint, "--enforce-eager")
    try:
        chat = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Say something."}]}
        attacks = [{"guided_grammar": chained_rules(3000)},
                   {"response_format": {"type": "json_schema", "json_schema": {
                       "name": "deep", "schema": json.loads(chained_refs(1200))}}}]
        for attack in attacks:
            response = httpx.post(f"{url}/v1/chat/completions", json={**chat, **attack},
                                  timeout=60)
            assert response.status_code == 400, response.text
            assert "crashed the grammar compiler" in response.json()["error"]["message"]
            assert httpx.post(f"{url}/v1/chat/completions", json=chat,
                              timeout=60).status_code == 200
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=60)
