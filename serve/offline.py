"""The offline API (vLLM's `LLM.generate`): every prompt of a list completed on one engine,
batched continuously, results in the prompts' order. `LLMEngine.generate` calls it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lathe.core.reporting import progress_bar
from lathe.serve.outputs import Completion, CompletionOutput
from lathe.serve.request_checks import RequestError
from lathe.serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lathe.serve.engine import LLMEngine


def generate(engine: LLMEngine, prompts: list[str] | list[list[int]],
             params: SamplingParams | list[SamplingParams] | None = None,
             progress: bool = False, adapter: str | None = None) -> list[Completion]:
    """Complete every prompt (text or token ids) on `engine`, on the LoRA adapter named
    `adapter` if given, with one `SamplingParams` for all or one per prompt (none: the
    engine's defaults, its checkpoint's recommended sampling); a progress bar of finished
    sequences when `progress`."""
    params_list = params if isinstance(params, list) else [
        params or engine.default_sampling_params()] * len(prompts)
    if len(params_list) != len(prompts):
        raise RequestError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
    completions: dict[str, Completion] = {}
    for prompt, p in zip(prompts, params_list, strict=True):
        prompt_ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = engine.add_request(prompt_ids, p, adapter=adapter)
        completions[request_id] = Completion(request_id, prompt_ids,
                                             [CompletionOutput(i) for i in range(p.n)])
    total = sum(p.n for p in params_list)
    with progress_bar(total=total, desc="generate", unit="seq", enabled=progress) as bar:
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.request_id in completions:
                    completions[delta.request_id].add(delta)
                    bar.update(delta.finish_reason is not None)
    return list(completions.values())
