"""A server's engine at a URL, behind the interface the in-process engine gives its callers
(`generate`, `eos_token_ids`): token-id prompts sent to any OpenAI-compatible
`/v1/completions` (lathe serve, vLLM) concurrently, so that the server batches them, and
their choices read back as `Completion`s — the tokens (`return_token_ids`), their
log-probabilities and why each stopped. `push` hands the server new weights of its model
through lathe serve's `POST /update_weights`: the trainer writes them where the server
may read them (its --weights-root) and the server swaps them in between requests. A LoRA
policy's adapters alone go through `push_adapter` instead (`/v1/load_lora_adapter`, vLLM's
too), each version under a name of its own that requests then ask for.

A completion that fails on the way — the connection, or an answer a server gives while it
is busy or restarting (408, 409, 429, 5xx, as OpenAI's client retries) — is sent again after
a backoff (its Retry-After when given), up to `max_retries` times; with a seed the server
draws the same tokens again. Any other answer fails at once.

Every sampling field is sent, each at its "off" value too, so that a server's recommended
defaults (a generation config, `lathe.serve.sampling_defaults`) change no rollout; a
server that still cuts completions short (its generation config's max_new_tokens) is
reported once. The log-probabilities a server returns are of the distribution before
temperature (vLLM's default, and lathe serve's): at temperature 1, the one sampled from.
`LocalServer` starts `lathe serve` in a process of its own for a trainer that has no server
to point at.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from torch import Tensor

from lathe.core.errors import ConfigError
from lathe.model.checkpoint import write_weights
from lathe.model.config import ModelConfig
from lathe.serve.core_messages import END_WITH
from lathe.serve.outputs import Completion, CompletionOutput, TokenLogprob
from lathe.serve.sampling_params import SamplingParams

RETRIED_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 0.5, 8.0

log = logging.getLogger("lathe.serve")


class RemoteEngine:
    """The engine of the server at `url` (its first model unless `model` names one)."""

    def __init__(self, url: str, eos_token_ids: set[int], api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0,
                 concurrency: int = 64, max_retries: int = 5) -> None:
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.eos_token_ids = set(eos_token_ids)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.concurrency = concurrency
        try:
            served = self.client.get("/v1/models")
        except httpx.HTTPError as error:
            raise ConfigError(f"rollout.url={url!r}: no server answers there ({error})") from None
        if served.status_code != 200:
            raise ConfigError(f"rollout.url={url!r}: GET /v1/models answered "
                              f"{served.status_code} ({served.text[:200]}); check the URL and "
                              "the API key") from None
        names = [entry["id"] for entry in served.json().get("data", [])]
        if model is not None and model not in names:
            raise ConfigError(f"rollout.url={url!r} serves {names}, not {model!r}")
        if not names:
            raise ConfigError(f"rollout.url={url!r} serves no model")
        self.model = model or names[0]
        self.weight_version = 0
        self._warned_short = False  # a completion the server cut short: said once
        self._pushed: Path | None = None
        self._adapters: list[tuple[str, Path]] = []  # pushed adapters the server holds

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 adapter: str | None = None, progress: bool = False) -> list[Completion]:
        """Complete every token-id prompt on the server, on its LoRA adapter `adapter` if
        given (one `push_adapter` loaded); results in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        model = adapter or self.model
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._complete, prompts, params_list, [model] * len(prompts)))

    def _complete(self, prompt: list[int], params: SamplingParams, model: str) -> Completion:
        # every sampling field, at its "off" value too: a server fills what a request leaves
        # unset with its checkpoint's recommended sampling (vLLM's --generation-config
        # auto, lathe serve's), which would change the distribution rollouts are drawn from
        body: dict[str, Any] = {
            "model": model, "prompt": list(prompt), "n": params.n,
            "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else -1,
            "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "seed": params.seed,
            "return_token_ids": True, "skip_special_tokens": params.skip_special_tokens}
        if params.stop:
            body["stop"] = list(params.stop)
        if params.logprobs is not None:
            body["logprobs"] = params.logprobs
        version = self.weight_version  # a server that does not say: the last one pushed
        response = self._post_retrying("/v1/completions", body)
        if response.status_code != 200:
            raise RuntimeError(f"{self.url}/v1/completions answered {response.status_code}: "
                               f"{response.text[:300]}")
        outputs: list[CompletionOutput] = []
        for choice in sorted(response.json()["choices"], key=lambda c: c["index"]):
            ids = choice.get("token_ids")
            if ids is None:
                raise RuntimeError(f"{self.url} returned no token_ids: it must take "
                                   "return_token_ids (lathe serve, vLLM >= 0.10.2)")
            if choice.get("finish_reason") == "length" and len(ids) < params.max_tokens \
                    and not self._warned_short:
                self._warned_short = True
                log.warning("%s ended a completion at %d of its max_tokens=%d: the server "
                            "limits every output (a generation config's max_new_tokens); "
                            "start it with --generation-config none (vLLM: vllm) for whole "
                            "rollouts", self.url, len(ids), params.max_tokens)
            scored = (choice.get("logprobs") or {}).get("token_logprobs") or []
            outputs.append(CompletionOutput(
                len(outputs), list(ids), choice.get("text") or "",
                [TokenLogprob(token, float(logprob), []) for token, logprob in
                 zip(ids, scored, strict=False)], choice.get("finish_reason"),
                int(choice.get("weight_version", version))))
        return Completion("", list(prompt), outputs)

    def _post_retrying(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """`POST path`, sent again after a backoff while it fails on the way or the server
        answers a retried status; the last answer (which may be an error the caller
        reports), or a `RuntimeError` when every attempt failed on the way."""
        attempt = 0
        while True:
            wait = min(BACKOFF_SECONDS * 2**attempt, MAX_BACKOFF_SECONDS)
            try:
                response = self.client.post(path, json=body)
            except httpx.TransportError as error:
                failure, response = f"{type(error).__name__}: {error}", None
            else:
                if response.status_code not in RETRIED_STATUSES:
                    return response
                failure = f"{response.status_code} {response.text[:200]}"
                wait = _retry_after(response, wait)
            if attempt == self.max_retries:
                if response is not None:
                    return response
                raise RuntimeError(f"{self.url}{path} failed {attempt + 1} times; the last: "
                                   f"{failure}")
            attempt += 1
            log.warning("%s%s failed (%s); retrying in %.1f s (%d of %d)", self.url, path,
                        failure, wait, attempt, self.max_retries)
            time.sleep(wait)

    def push(self, state: Mapping[str, Tensor], config: ModelConfig, folder: str | Path) -> int:
        """Write `state` under `folder` (a new subfolder each push, the last one removed once
        the server has loaded the next) and have the server load it; its weight version."""
        target = Path(folder) / f"push-{self.weight_version + 1:06d}"
        write_weights(dict(state), config, target)
        response = self.client.post("/update_weights", json={"path": str(target.resolve())})
        if response.status_code != 200:
            shutil.rmtree(target, ignore_errors=True)
            raise RuntimeError(f"{self.url}/update_weights answered {response.status_code}: "
                               f"{response.text[:300]}")
        if self._pushed is not None:
            shutil.rmtree(self._pushed, ignore_errors=True)
        self._pushed = target
        self.weight_version = int(response.json().get("weight_version", self.weight_version + 1))
        return self.weight_version

    def push_adapter(self, folder: Path, name: str) -> None:
        """Have the server load the peft adapter `folder` (inside its --lora-root) as `name`.
        The one loaded before stays for requests still naming it (a step sampling while the
        next trains); the one before that is unloaded and its folder removed."""
        while len(self._adapters) >= 2:
            old, old_folder = self._adapters.pop(0)
            response = self.client.post("/v1/unload_lora_adapter", json={"lora_name": old})
            if response.status_code not in (200, 404):
                raise RuntimeError(f"{self.url}/v1/unload_lora_adapter answered "
                                   f"{response.status_code}: {response.text[:300]}")
            shutil.rmtree(old_folder, ignore_errors=True)
        response = self.client.post("/v1/load_lora_adapter", json={
            "lora_name": name, "lora_path": str(Path(folder).resolve())})
        if response.status_code != 200:
            raise RuntimeError(f"{self.url}/v1/load_lora_adapter answered "
                               f"{response.status_code}: {response.text[:300]}; the server "
                               "needs --api-key, --lora-root covering rollout.weights_dir and "
                               "--max-loras 2 (with --max-lora-rank at least the policy's)")
        self._adapters.append((name, Path(folder)))

    def close(self) -> None:
        self.client.close()


def _retry_after(response: httpx.Response, default: float) -> float:
    """A Retry-After header's seconds (bounded), else `default`."""
    try:
        return min(max(float(response.headers.get("retry-after", "")), 0.0), MAX_BACKOFF_SECONDS)
    except ValueError:
        return default


class LocalServer:
    """`lathe serve CHECKPOINT` in a process of its own on a free loopback port, taking
    pushes from `weights_root` under a fresh API key (passed in its environment), until
    `stop` — or until the process that started it dies (the kernel ends it then, on
    Linux). `url` and `api_key` once it answers /health. `eager` runs every step eagerly
    (`--enforce-eager`) and `num_blocks` fixes its KV cache (`--num-blocks`), as a trainer
    beside it on the same cores or card needs; the checkpoint's generation config is not
    applied (`--generation-config none`)."""

    def __init__(self, checkpoint: str | Path, weights_root: str | Path,
                 timeout: float = 600.0, lora_rank: int | None = None, eager: bool = False,
                 num_blocks: int | None = None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url, self.api_key = f"http://127.0.0.1:{port}", secrets.token_hex(16)
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lathe.core.cli", "serve", str(checkpoint), "--host",
             "127.0.0.1", "--port", str(port), "--weights-root", str(weights_root),
             *([] if lora_rank is None else ["--lora-root", str(weights_root), "--max-loras",
                                             "2", "--max-lora-rank", str(lora_rank)]),
             "--generation-config", "none",  # rollouts sample as the trainer asks, in full
             *(["--enforce-eager"] if eager else []),
             *([] if num_blocks is None else ["--num-blocks", str(num_blocks)])],
            env={**os.environ, "LATHE_API_KEY": self.api_key, END_WITH: str(os.getpid())},
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise RuntimeError(f"lathe serve {checkpoint} did not come up at {self.url} "
                                   f"(exit {self.process.returncode}); its log ends:\n{tail}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
