"""Structured outputs on a random tiny model: what a constrained request generates always
matches its JSON schema, regex, choice or grammar — sampled at temperature 1, streamed,
n > 1, beside unconstrained rows (which stay bit-identical), under speculative decoding
and preemption — and a constraint that cannot compile is a 400 naming its field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from lathe.serve.config import EngineConfig, SpeculativeConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.protocol import ChatCompletionRequest, ProtocolError
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.structured import MAX_SPEC_CHARS, Literals, StructuredOutput
from tests.builders import serve_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["red", "green"]}}}}
SPEC = StructuredOutput(json=json.dumps(SCHEMA))
MESSAGES = [{"role": "user", "content": "Describe the river as JSON."}]


def json_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "river", "schema": schema,
                                                   "strict": True}}


def test_every_sampled_json_schema_output_parses_and_validates(client):
    for seed in range(50):
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=96, temperature=1.0, seed=seed,
            response_format=json_format())
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize(("extra", "check"), [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"extra_body": {"guided_regex": "[0-9]{3}-[a-z]{2}"}},
     lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"extra_body": {"guided_choice": ["yes", "no", "maybe later"]}},
     lambda t: t in ("yes", "no", "maybe later")),
    ({"extra_body": {"guided_grammar": 'start: "go " DIR\nDIR: "north" | "south"'}},
     lambda t: t in ("go north", "go south")),
    ({"extra_body": {"guided_grammar": 'root ::= "go " dir\ndir ::= "east" | "west"'}},
     lambda t: t in ("go east", "go west")),
    ({"extra_body": {"guided_json": SCHEMA}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_each_kind_of_constraint_holds_on_both_endpoints(client, extra, check):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=96,
                                          temperature=1.0, seed=3, n=3, **extra)
    body = extra.get("extra_body") or {"response_format": extra["response_format"]}
    completion = client.completions.create(model="tiny", prompt="The river", max_tokens=96,
                                           temperature=1.0, seed=4, extra_body=body)
    outputs = [(c.message.content, c.finish_reason) for c in chat.choices] + [
        (completion.choices[0].text, completion.choices[0].finish_reason)]
    # an unbounded JSON object may still be open at max_tokens; all else completes
    assert all(check(text) for text, reason in outputs if reason == "stop"), outputs
    assert all(reason == "stop" for _, reason in outputs) or "json_object" in str(extra)


def test_the_responses_text_format_constrains_as_response_format_does(client):
    """The Responses API's text.format json_schema is the chat route's response_format:
    at the same seed the same output, which parses and holds to the schema."""
    response = client.responses.create(
        model="tiny", input=MESSAGES, max_output_tokens=96, temperature=1.0,
        extra_body={"seed": 5}, text={"format": {"type": "json_schema", "name": "river",
                                                 "schema": SCHEMA, "strict": True}})
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=96,
                                          temperature=1.0, seed=5,
                                          response_format=json_format())
    assert response.output_text == chat.choices[0].message.content
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_a_stream_concatenates_to_the_unstreamed_result(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=96, temperature=1.0, seed=11,
                  response_format=json_format(), logprobs=True)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    assert len(whole.logprobs.content) > 3


def test_unconstrained_rows_are_bit_identical_beside_constrained_ones(checkpoint):
    # an engine of its own: the server's is stepped by its core thread meanwhile, which
    # can take these requests' deltas (this test once hung there)
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=128,
                                                                max_num_batched_tokens=64))
    plain = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, logprobs=2)
             for s in range(4)]
    alone = engine.generate(["The river"] * 4, plain)
    constrained = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured=SPEC)
                   for s in range(4)]
    mixed = engine.generate(["The river"] * 8, [p for pair in zip(plain, constrained,
                                                                  strict=True) for p in pair])
    for a, b in zip(alone, mixed[::2], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == \
            [lp.logprob for lp in b.outputs[0].logprobs]
    for done in mixed[1::2]:
        jsonschema.validate(json.loads(done.outputs[0].text), SCHEMA)


def test_constraints_hold_under_speculation_and_preemption(checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(
        num_blocks=40, block_size=4, max_num_seqs=8,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)))
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s,
                             structured=SPEC if s % 2 else None) for s in range(8)]
    outputs = engine.generate(["The river flows past the old mill"] * 8, params)
    assert engine.scheduler.num_preemptions > 0
    for done, p in zip(outputs, params, strict=True):
        if p.structured is not None:
            assert done.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(done.outputs[0].text), SCHEMA)
    assert engine.block_manager.usage == 0 and not engine.sampler.constraints.matchers
    before = engine.stats()["spec_decode_num_accepted_tokens"]
    greedy = engine.generate(["The river flows past the old mill"] * 4, [
        SamplingParams(max_tokens=64, temperature=t, seed=1, structured=SPEC)
        for t in (0.0, 0.0, 1.0, 1.0)])
    assert engine.stats()["spec_decode_num_accepted_tokens"] > before
    for done in greedy:  # drafts were cut to the grammar and verified under its masks
        jsonschema.validate(json.loads(done.outputs[0].text), SCHEMA)


@pytest.mark.parametrize(("extra", "field", "named"), [
    ({"response_format": {"type": "xml"}}, "response_format", "'xml' is not one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be"),
    ({"response_format": json_format({"type": "objectx"})}, "response_format",
     "Invalid type: objectx"),
    ({"extra_body": {"guided_regex": "(+"}}, "guided_regex", "invalid regex"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar",
     "unknown name"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "not JSON"),
    ({"extra_body": {"guided_json": [1, 2]}}, "guided_json", "guided_json"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "at least 1"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice",
     "give one structured output per request"),
    ({"extra_body": {"guided_regex": "a", "ignore_eos": True}}, None,
     "ignore_eos cannot be combined"),
])
def test_a_constraint_that_cannot_hold_is_a_400_naming_its_field(client, extra, field, named):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, **extra)
    error = caught.value.body
    assert named in error["message"]
    if field is not None:
        assert error["param"] == field


def test_a_schema_past_the_size_limit_is_refused_by_name():
    schema = {"type": "object", "description": "x" * MAX_SPEC_CHARS}
    request = ChatCompletionRequest(model="tiny", messages=MESSAGES, guided_json=schema)
    with pytest.raises(ProtocolError, match="guided_json: the json constraint has") as caught:
        request.structured_output(Literals({}))
    assert caught.value.param == "guided_json"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_constrained_speculation_is_constrained_decoding_token_for_token(checkpoint,
                                                                               method):
    base = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=256))
    vocab = base.model.config.vocab_size
    draft = serve_model(vocab, n_layers=1, init_std=0.1) if method == "draft" else None
    spec = LLMEngine(base.model, base.tokenizer, EngineConfig(
        num_blocks=256, max_num_batched_tokens=24,
        speculative=SpeculativeConfig(method, num_speculative_tokens=3)),
        base.eos_token_ids, draft_model=draft)
    prompts = ["The river flows past the old mill", "A garden", "The river flows"] * 2
    params = [SamplingParams(max_tokens=64, temperature=0, structured=spec_)
              for spec_ in (SPEC, StructuredOutput(regex="(ab|abc){2,9}x"),
                            StructuredOutput(choice=("left", "leftover")))] * 2
    expected = [d.outputs[0].token_ids for d in base.generate(prompts, params)]
    assert [d.outputs[0].token_ids for d in spec.generate(prompts, params)] == expected
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


def test_multi_step_runs_keep_every_row_as_single_steps_do(checkpoint):
    """Constrained rows ride a multi-step run (masked at each pass) instead of cutting it
    short: every row's tokens equal one-pass-per-step decoding's."""
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s,
                             structured=SPEC if s % 2 else None) for s in range(6)]
    runs = []
    for decode_steps in (1, 4):
        engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=256,
                                                                    decode_steps=decode_steps))
        runs.append([d.outputs[0].token_ids for d in engine.generate(["The river"] * 6,
                                                                     params)])
    assert runs[0] == runs[1]


def test_a_compile_past_the_time_limit_is_a_400(checkpoint):
    from tests.serve.conftest import start_server, wait_healthy

    server, thread, url = start_server(checkpoint, grammar_seconds=1e-6)
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        late = "did not compile within 1e-06 s"
        with pytest.raises(openai.BadRequestError, match=late) as caught:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                           response_format=json_format())
        assert caught.value.body["param"] == "response_format"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_matcher_failing_mid_generation_fails_its_request_alone(client, running,
                                                                   monkeypatch):
    """llguidance may refuse a token its own mask allowed (its lexer's limits: "too many
    expressions constructed", seen once in CI on `start: "a"+`). That request gets a 400
    with the reason, its compiled grammar is dropped, and the engine serves on: the next
    constrained and unconstrained requests succeed."""
    from lathe.serve.constraints import Constraints
    constraints = running.engine().sampler.constraints
    real_start, failed = Constraints.start, []

    class RefusingMatcher:  # llguidance's matcher, but its first consume fails as in CI
        def __init__(self, matcher):
            self.matcher = matcher

        def consume_token(self, token):
            failed.append(token)
            return False

        def get_error(self):
            return "lexer error: too many expressions constructed"

        def __getattr__(self, name):
            return getattr(self.matcher, name)

    def start_refusing_once(self, key, spec):
        real_start(self, key, spec)
        if not failed:
            self.matchers[key] = RefusingMatcher(self.matchers[key])

    grammar = {"guided_grammar": 'start: "go " DIR\nDIR: "north" | "south"'}
    client.completions.create(model="tiny", prompt="The river", max_tokens=8,
                              extra_body=grammar)  # compiled and cached
    monkeypatch.setattr(Constraints, "start", start_refusing_once)
    with pytest.raises(openai.BadRequestError, match="the structured output could not go on"):
        client.completions.create(model="tiny", prompt="The river", max_tokens=8,
                                  extra_body=grammar)
    spec = StructuredOutput(grammar=grammar["guided_grammar"])
    assert spec not in constraints.compiler._compiled
    again = client.completions.create(model="tiny", prompt="The river", max_tokens=8,
                                      extra_body=grammar)
    assert again.choices[0].text in ("go north", "go south")
    plain = client.completions.create(model="tiny", prompt="The river", max_tokens=4)
    assert plain.choices[0].finish_reason == "length"
    assert running.engine().num_running == 0 and not running.engine().sampler.broken
