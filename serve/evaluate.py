"""`lathe eval`: lm-evaluation-harness tasks scored in-process on lathe's engine.

`LatheLM` is an lm-eval model (its `TemplateLM`) over an `LLMEngine`, so every task lm-eval
ships — or a YAML task of your own (`--include-path`) — runs with continuous batching, the
paged KV cache, quantized weights and LoRA adapters, without a server. It reads a checkpoint
as lm-eval's `hf` model does, so the two score each sample alike:
- log-likelihoods: the context and continuation encoded whole, without special tokens, the
  context's trailing spaces moved to the continuation (lm-eval's split), an empty context
  replaced by BOS (else EOS); each continuation token scored from the engine's prompt
  log-probs, greedy when no token was more likely (rank 1);
- rolling log-likelihoods (perplexity tasks): lm-eval's disjoint windows of the model's
  context;
- generations: greedy unless the task samples, stopped at the task's `until` strings and
  EOS, the context cut to leave `max_gen_toks` (256 by default) of room, as `hf` cuts it;
  the generated tokens decoded whole; `--apply-chat-template` renders requests through
  the checkpoint's chat template.
Results go to `--output` as JSON (atomically) and to the terminal as lm-eval's table.
"""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lathe.core.atomic import write_json
from lathe.core.checkpoint_files import read_json_object
from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder, chat_encoder
from lathe.serve.config import EngineConfig, QuantMode
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams

try:  # lm-eval is optional: `pip install lm_eval` (or lathe's dev extra)
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - exercised where lm_eval is missing
    TemplateLM = object  # type: ignore[assignment,misc]
if typing.TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

MAX_GEN_TOKS = 256  # lm-eval's hf default


class LatheLM(TemplateLM):  # type: ignore[misc,valid-type]
    def __init__(self, engine: LLMEngine, bos_id: int | None, eos_id: int,
                 encoder: ChatEncoder | None = None, adapter: str | None = None) -> None:
        """`bos_id`, `eos_id`: the tokenizer's own (`special_ids`), as lm-eval's hf reads
        them."""
        super().__init__()
        self.engine, self.encoder, self.adapter = engine, encoder, adapter
        self.tokenizer = engine.tokenizer
        self.bos_id, self.eos_id = bos_id, eos_id
        self.max_length = engine.max_model_len

    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.bos_id if self.bos_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether it is the greedy continuation) of each
        (key, context ids, continuation ids): the pair's last max_length tokens scored."""
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                score_only=True)
        prompts = [(context + continuation)[-self.max_length:]
                   for _, context, continuation in requests]
        outputs = self.engine.generate(prompts, params, progress=not disable_tqdm,
                                       adapter=self.adapter)
        results = []
        for (key, _, continuation), output in zip(requests, outputs, strict=True):
            scored = output.prompt_logprobs[-len(continuation):]
            result = (sum(t.logprob for t in scored), all(t.rank == 1 for t in scored))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in [request.args for request in requests]:
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(logprob for logprob, _ in self._loglikelihood_tokens(
                [(None, context, continuation) for context, continuation in windows],
                disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, settings in [request.args for request in requests]:
            settings = dict(settings)
            until = settings.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos and eos not in until:
                until.append(eos)
            max_new = int(settings.pop("max_gen_toks", MAX_GEN_TOKS))
            sample = settings.pop("do_sample", False)
            temperature = float(settings.pop("temperature", 0.0)) if sample else 0.0
            room = max(self.max_length - max_new, 1)
            prompts.append(self.tok_encode(context)[-room:])
            params.append(SamplingParams(max_tokens=max_new, temperature=temperature,
                                         stop=until))
            stops.append(until)
        outputs = self.engine.generate(prompts, params, progress=not disable_tqdm,
                                       adapter=self.adapter)
        texts = []
        for (context, settings), output, until in zip(
                [request.args for request in requests], outputs, stops, strict=True):
            # the tokens decoded whole, as hf's are (a cut character decodes as U+FFFD there,
            # where the engine's streamed text holds its bytes back)
            text = self.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, settings), text)
            texts.append(text)
        return texts

    @property
    def tokenizer_name(self) -> str:
        return "lathe"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return None if self.encoder is None else self.encoder.template.source

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        if self.encoder is None:
            raise ConfigError("--apply-chat-template needs the checkpoint's chat template")
        return self.encoder.render(chat_history, add_generation_prompt=add_generation_prompt)


def special_ids(checkpoint: Path, engine: LLMEngine) -> tuple[int | None, int]:
    """The BOS and EOS ids tokenizer_config.json names (lm-eval's prefix for an empty
    context, and its end of text); EOS falls back to the engine's lowest end id."""
    file = checkpoint / "tokenizer_config.json"
    config = read_json_object(file) if file.is_file() else {}
    ids = []
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        ids.append(engine.tokenizer.token_to_id(token) if isinstance(token, str) else None)
    bos, eos = ids
    if eos is None:
        if not engine.eos_token_ids:
            raise ConfigError(f"{checkpoint} names no EOS token (tokenizer_config.json or "
                              "generation_config.json); lm-eval needs one")
        eos = min(engine.eos_token_ids)
    return bos, eos


def task_manager(include_path: Path | None, tasks: list[str]) -> TaskManager:
    """lm-eval's index of the tasks: of `include_path` alone when it defines every task
    asked for — indexing the ~14,000 YAML files lm-eval ships takes ~11 s — else of those
    and lm-eval's own."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return TaskManager(include_path=None if include_path is None else str(include_path))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe eval", description="Score a checkpoint on lm-evaluation-harness tasks, "
                                       "in-process on lathe's engine.")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", type=Path, help="a folder of your own task YAMLs")
    parser.add_argument("--limit", type=float, help="samples per task (or a fraction)")
    parser.add_argument("--num-fewshot", type=int)
    parser.add_argument("--apply-chat-template", action="store_true")
    parser.add_argument("--lora", type=Path, help="a PEFT adapter folder to evaluate with")
    parser.add_argument("--quantize", choices=typing.get_args(QuantMode))
    parser.add_argument("--output", type=Path, help="results JSON (default: print only)")
    parser.add_argument("--log-samples", action="store_true",
                        help="keep each sample's requests and responses in --output")
    args = parser.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.utils import make_table
    except ImportError:
        raise ConfigError("lathe eval needs lm-evaluation-harness: pip install lm_eval") from None
    if not (args.checkpoint / "config.json").is_file():
        raise ConfigError(f"{args.checkpoint}: no config.json; give a checkpoint folder")
    config = EngineConfig()
    if args.lora is not None:
        adapter_config = args.lora / "adapter_config.json"
        if not adapter_config.is_file():
            raise ConfigError(f"--lora {args.lora}: no adapter_config.json; give a PEFT "
                              "adapter folder")
        rank = int(read_json_object(adapter_config).get("r", EngineConfig.max_lora_rank))
        config = EngineConfig(max_loras=1, max_lora_rank=rank)
    engine = LLMEngine.from_checkpoint(args.checkpoint, config, quantize=args.quantize)
    adapter = None
    if args.lora is not None:
        engine.add_adapter("eval", args.lora)
        adapter = "eval"
    encoder = chat_encoder(args.checkpoint) if args.apply_chat_template else None
    model = LatheLM(engine, *special_ids(args.checkpoint, engine), encoder, adapter)
    tasks = args.tasks.split(",")
    results = lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=task_manager(args.include_path, tasks),
        limit=args.limit,
        num_fewshot=args.num_fewshot, apply_chat_template=args.apply_chat_template,
        log_samples=args.log_samples)
    print(make_table(results))
    if args.output is not None:
        write_json(args.output, json.loads(json.dumps(results, default=str)))
        print(f"results: {args.output}")
    return 0
