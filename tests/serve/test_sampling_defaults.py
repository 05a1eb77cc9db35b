"""A checkpoint's generation_config.json sampling is the default of every request that does
not set its own (vLLM's `--generation-config auto`), its max_new_tokens the limit of every
request's output; `--generation-config none` or another folder replaces it; a wrong file is
refused before the server starts."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import pytest

from lathe.core.errors import CheckpointError, ConfigError
from lathe.serve.config import EngineConfig, ServerConfig
from lathe.serve.sampling_defaults import read_sampling_defaults, sampling_defaults
from tests.serve.conftest import served

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
         "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
         "transformers_version": "4.51.0"}


def write_generation_config(folder, fields: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(fields))


def test_the_sampling_fields_of_a_generation_config_are_read_and_checked(tmp_path):
    write_generation_config(tmp_path / "qwen3", QWEN3)
    assert read_sampling_defaults(tmp_path / "qwen3") == {"temperature": 0.6, "top_k": 20,
                                                          "top_p": 0.95}
    write_generation_config(tmp_path / "gemma3", {"do_sample": True, "top_k": 64,
                                                  "top_p": 0.95, "max_new_tokens": 512,
                                                  "repetition_penalty": None})
    assert read_sampling_defaults(tmp_path / "gemma3") == {"top_k": 64, "top_p": 0.95,
                                                           "max_tokens": 512}
    assert read_sampling_defaults(tmp_path) == {}  # no file: nothing recommended
    assert sampling_defaults("none", tmp_path / "qwen3") == {}
    assert sampling_defaults(str(tmp_path / "gemma3"), tmp_path / "qwen3")["top_k"] == 64
    for key, value, message in (("temperature", 3.0, r"temperature=3.0 must be a number "
                                                     r"in \[0, 2\]"),
                                ("top_p", "0.9", r"top_p='0.9' must be a number in \(0, 1\]"),
                                ("top_k", 2.5, r"top_k=2.5 must be an integer"),
                                ("max_new_tokens", 0, r"max_new_tokens=0 must be an integer "
                                                      r"in \[1,"),
                                ("min_p", True, r"min_p=True must be a number")):
        write_generation_config(tmp_path / "bad", {**QWEN3, key: value})
        with pytest.raises(CheckpointError, match=rf"generation_config.json: {message}.*"
                                                  "--generation-config none"):
            read_sampling_defaults(tmp_path / "bad")


def test_a_generation_config_flag_names_a_folder_that_holds_one(checkpoint, tmp_path):
    assert ServerConfig(checkpoint=checkpoint).generation_config == "auto"
    with pytest.raises(ConfigError, match="generation_config='vllm': give auto"):
        ServerConfig(checkpoint=checkpoint, generation_config="vllm")
    write_generation_config(tmp_path, QWEN3)
    folder = ServerConfig(checkpoint=checkpoint, generation_config=str(tmp_path))
    assert sampling_defaults(folder.generation_config, checkpoint)["top_k"] == 20


@pytest.fixture
def recommending(checkpoint, tmp_path):
    """The test checkpoint, its generation_config.json recommending top_k 1 (greedy
    whatever the temperature) and at most 5 new tokens."""
    copy = shutil.copytree(checkpoint, tmp_path / "recommending")
    fields = json.loads((copy / "generation_config.json").read_text())
    write_generation_config(copy, {**fields, "top_k": 1, "max_new_tokens": 5})
    return copy


def chat(url: str, **fields) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story"}],
            "ignore_eos": True, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_requests_sample_with_the_checkpoints_recommendation_unless_they_set_their_own(
        recommending):
    engine = EngineConfig(num_blocks=64)
    with served(recommending, engine=engine) as url:
        greedy = chat(url, temperature=0, max_tokens=5)
        tokens = greedy["usage"]["completion_tokens"]
        assert tokens == 5
        sampled = chat(url, temperature=1.0, seed=3)  # top_k 1 and 5 tokens, recommended
        assert sampled["choices"][0]["message"] == greedy["choices"][0]["message"]
        assert sampled["usage"]["completion_tokens"] == 5
        asked_more = chat(url, temperature=0, max_tokens=9)  # the limit holds all requests
        assert asked_more["usage"]["completion_tokens"] == 5
        assert asked_more["choices"][0]["finish_reason"] == "length"
        own = [chat(url, temperature=1.0, seed=seed, top_k=0)["choices"][0]["message"]
               for seed in range(3)]
        assert any(message != greedy["choices"][0]["message"] for message in own)
        completion = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": "the cat", "max_tokens": 9, "temperature": 1.0,
            "seed": 3, "ignore_eos": True}, timeout=60).json()
        assert completion["usage"]["completion_tokens"] == 5
    with served(recommending, engine=engine, generation_config="none") as url:
        assert chat(url, temperature=0, max_tokens=9)["usage"]["completion_tokens"] == 9
        free = [chat(url, temperature=1.0, seed=seed, max_tokens=5)["choices"][0]["message"]
                for seed in range(3)]
        assert any(message != greedy["choices"][0]["message"] for message in free)


def test_lathe_chat_samples_as_the_server_would_locally_and_sends_only_what_it_is_given(
        recommending, capsys):
    from lathe.serve.chat import LocalChat
    from lathe.serve.commands import chat_main
    local = LocalChat(recommending)
    messages = [{"role": "user", "content": "tell me a story"}]
    greedy = "".join(local.reply(messages, {"temperature": 0.0, "max_tokens": 5}))
    # top_k 1 recommended: greedy at any temperature; max_new_tokens 5: no longer
    assert "".join(local.reply(messages, {"temperature": 1.0, "seed": 3,
                                          "max_tokens": 50})) == greedy
    with served(recommending, engine=EngineConfig(num_blocks=64)) as url:
        assert chat_main([url, "--prompt", "tell me a story", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy + "\n"


def test_rollouts_sample_as_the_trainer_asks_whatever_the_server_recommends(recommending,
                                                                            tmp_path, caplog):
    """`RemoteEngine` sends every sampling field, so a server's recommended top_k 1 changes
    no rollout; the trainer's own server applies no generation config, and another's output
    limit, which would cut rollouts short, is reported."""
    from lathe.serve.engine import LLMEngine
    from lathe.serve.remote import LocalServer, RemoteEngine
    from lathe.serve.sampling_params import SamplingParams
    offline = LLMEngine.from_checkpoint(recommending, EngineConfig(num_blocks=64))
    prompt = [[5, 6, 7, 8]]
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    (want,) = offline.generate(prompt, sampled)
    (first,) = offline.generate(prompt, greedy)
    assert want.outputs[0].token_ids != first.outputs[0].token_ids
    assert len(first.outputs[0].token_ids) == 8
    with served(recommending, engine=EngineConfig(num_blocks=64)) as url:
        remote = RemoteEngine(url, offline.eos_token_ids)
        with caplog.at_level(logging.WARNING, logger="lathe.serve"):
            (got,) = remote.generate(prompt, sampled)  # cut at the recommended 5 tokens
            (cut,) = remote.generate(prompt, greedy)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids[:5]
        assert cut.outputs[0].token_ids == first.outputs[0].token_ids[:5]
        assert caplog.text.count("ended a completion at 5 of its max_tokens=8") == 1
        remote.close()
    server = LocalServer(recommending, tmp_path, timeout=120, eager=True, num_blocks=64)
    try:
        remote = RemoteEngine(server.url, offline.eos_token_ids, server.api_key)
        assert remote.generate(prompt, sampled)[0].outputs[0].token_ids == \
            want.outputs[0].token_ids
        remote.close()
    finally:
        server.stop()


def test_the_offline_engine_samples_as_recommended_when_given_no_params(recommending):
    """vLLM's `LLM.generate` without sampling params: the checkpoint's recommended (top_k 1:
    greedy at temperature 1; 5 tokens), `default_sampling_params`."""
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams
    engine = LLMEngine.from_checkpoint(recommending, EngineConfig(num_blocks=64))
    assert engine.default_sampling_params() == SamplingParams(top_k=1, max_tokens=5)
    (given,) = engine.generate([[5, 6, 7, 8]])
    (greedy,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=5, temperature=0))
    assert given.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert LLMEngine(engine.model).default_sampling_params() == SamplingParams()
