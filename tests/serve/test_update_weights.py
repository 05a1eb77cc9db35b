"""POST /update_weights: a trainer's push of new weights (a folder of safetensors shards)
makes the server's greedy output the new policy's, token for token as that policy
generates it itself; requests streaming when the push comes finish whole on the old
weights; the endpoint refuses a missing key (401), a folder outside --weights-root (403)
and weights of another model (400)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch

from lathe.model import load_checkpoint
from lathe.model.checkpoint import write_weights
from lathe.model.generate import generate
from lathe.serve.config import EngineConfig
from tests.serve.conftest import API_KEY, served

PROMPT = "The river flows past the old mill"


def greedy(model, tokenizer_ids: list[int], steps: int) -> list[int]:
    """The policy's own greedy continuation (the trainer's side of the check)."""
    return generate(model, torch.tensor([tokenizer_ids]), steps)[0].tolist()


@pytest.fixture(scope="module")
def pushed(checkpoint, tmp_path_factory):
    """The served model, and a changed copy of it pushed to a weights root."""
    root = tmp_path_factory.mktemp("pushes")
    old = load_checkpoint(checkpoint)
    new = load_checkpoint(checkpoint)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    write_weights(new.state_dict(), new.config, root / "step-1")
    return root, old, new


def test_a_push_makes_the_server_generate_the_new_policys_tokens(checkpoint, pushed):
    root, old, new = pushed
    with served(checkpoint, api_key=API_KEY, weight_roots=[root],
                engine=EngineConfig(num_blocks=256)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)

        versions = []

        def complete() -> list[int]:
            choice = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                extra_body={"return_token_ids": True}).choices[0]
            versions.append(choice.model_extra["weight_version"])
            return choice.model_extra["token_ids"]

        prompt = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1,
                                           extra_body={"return_token_ids": True}
                                           ).choices[0].model_extra["prompt_token_ids"]
        before = complete()
        assert before == greedy(old, prompt, 16)[:len(before)]
        push = httpx.post(f"{url}/update_weights", json={"path": str(root / "step-1")},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert push.status_code == 200 and push.json()["weight_version"] == 1, push.text
        after = complete()
        assert after != before and after == greedy(new, prompt, 16)[:len(after)]
        assert versions == [0, 1]  # each answer says which weights drew it


def test_requests_streaming_at_a_push_finish_on_the_old_weights(checkpoint, pushed):
    """The push waits for the running stream, which ends whole (all its tokens, each the
    old policy's); the next request is the new policy's."""
    root, old, new = pushed
    with served(checkpoint, api_key=API_KEY, weight_roots=[root],
                engine=EngineConfig(num_blocks=256)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        body = {"ignore_eos": True, "return_token_ids": True}
        chunks = iter(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=48,
                                                temperature=0, stream=True, extra_body=body))
        first = next(chunks)  # running before the push arrives
        prompt = first.choices[0].model_extra["prompt_token_ids"]
        tokens = list(first.choices[0].model_extra["token_ids"])
        result: dict = {}

        def push() -> None:
            result["response"] = httpx.post(
                f"{url}/update_weights", json={"path": str(root / "step-1")},
                headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)

        pusher = threading.Thread(target=push)
        pusher.start()
        finish = None
        for chunk in chunks:
            tokens += chunk.choices[0].model_extra["token_ids"]
            finish = chunk.choices[0].finish_reason or finish
        pusher.join(timeout=60)
        assert result["response"].status_code == 200
        assert finish == "length" and tokens == greedy(old, prompt, 48)
        after = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=48,
                                          temperature=0, extra_body=body)
        assert after.choices[0].model_extra["token_ids"] == greedy(new, prompt, 48)


def test_update_weights_refuses_what_it_must(checkpoint, pushed, tmp_path):
    root, old, _ = pushed
    other = load_checkpoint(checkpoint)
    wrong = write_weights({k: v for k, v in other.state_dict().items()
                           if "layers.0." not in k}, other.config, root / "partial")
    outside = write_weights(other.state_dict(), other.config, tmp_path / "elsewhere")
    with served(checkpoint, api_key=API_KEY, weight_roots=[root]) as url:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        missing = httpx.post(f"{url}/update_weights", json={"path": str(root / "step-1")})
        assert missing.status_code == 401
        away = httpx.post(f"{url}/update_weights", json={"path": str(outside)},
                          headers=headers)
        assert away.status_code == 403 and "--weights-root" in away.json()["error"]["message"]
        bad = httpx.post(f"{url}/update_weights", json={"path": str(wrong)}, headers=headers,
                         timeout=60)
        assert bad.status_code == 400 and "missing" in bad.json()["error"]["message"]
    with served(checkpoint) as url:  # no key, no roots: off
        off = httpx.post(f"{url}/update_weights", json={"path": str(root / "step-1")})
        assert off.status_code == 403
