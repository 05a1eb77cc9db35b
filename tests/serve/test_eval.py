"""`lathe eval` scores lm-eval tasks in-process on lathe's engine as lm-eval's own `hf`
model scores the same checkpoint in transformers: each multiple-choice log-likelihood
within 1e-4 and its greedy flag, each rolling (perplexity) log-likelihood, each greedy
generation's text; the command writes its results JSON and refuses what it cannot read."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lathe.core.cli import run_command
from lathe.serve.engine import LLMEngine
from lathe.serve.evaluate import LatheLM, special_ids, task_manager
from tests.serve.test_lm_eval import write_task

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow


def write_tasks(folder) -> tuple[str, str, str]:
    """The multiple-choice task of the server test, a perplexity task and a generation task
    over the same prose."""
    choice = write_task(folder)
    rng = random.Random(1)
    words = ["the river", "ran past", "the old mill", "and", "a quiet town", "stood near",
             "the hills", "by the road", "waited", "the garden"]
    with open(folder / "texts.jsonl", "w") as f:
        for _ in range(6):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")
    common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "texts.jsonl"}
test_split: test
"""
    (folder / "lathe_ppl.yaml").write_text(f"""task: lathe_ppl
{common}output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")
    (folder / "lathe_gen.yaml").write_text(f"""task: lathe_gen
{common}output_type: generate_until
doc_to_text: "{{{{text[:20]}}}}"
doc_to_target: "{{{{text[20:40]}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return choice, "lathe_ppl", "lathe_gen"


def responses(model, folder, task: str, chat: bool = False) -> list:
    result = lm_eval.simple_evaluate(model=model, tasks=[task], log_samples=True,
                                     task_manager=task_manager(folder, [task]),
                                     batch_size=1, apply_chat_template=chat)
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_lathe_eval_scores_as_lm_evals_hf_model(checkpoint, tmp_path):
    tasks = write_tasks(tmp_path)
    engine = LLMEngine.from_checkpoint(checkpoint)
    ours = LatheLM(engine, *special_ids(checkpoint, engine))
    for task in tasks:
        mine = responses(ours, tmp_path, task)
        from lm_eval.models.huggingface import HFLM
        theirs = responses(HFLM(pretrained=str(checkpoint), dtype="float32", device="cpu",
                                batch_size=1), tmp_path, task)
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs, strict=True):
            for x, y in zip(a, b, strict=True):
                if task == "lathe_gen":
                    assert x == y
                elif task == "lathe_ppl":
                    assert x[0] == pytest.approx(y[0], abs=1e-4) and x[0] < -1
                else:
                    assert x[0][0] == pytest.approx(y[0][0], abs=1e-4) and x[0][1] == y[0][1]


def test_a_chat_template_renders_requests_as_hfs_does(checkpoint, tmp_path):
    """--apply-chat-template: each request rendered through the checkpoint's template (the
    generation prompt opening the answer) scores as hf scores it through transformers'."""
    from lm_eval.models.huggingface import HFLM

    from lathe.data.chat_encoding import chat_encoder
    task = write_tasks(tmp_path)[0]
    engine = LLMEngine.from_checkpoint(checkpoint)
    ours = responses(LatheLM(engine, *special_ids(checkpoint, engine), chat_encoder(checkpoint)),
                     tmp_path, task, chat=True)
    theirs = responses(HFLM(pretrained=str(checkpoint), dtype="float32", device="cpu",
                            batch_size=1), tmp_path, task, chat=True)
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x[0][0] == pytest.approx(y[0][0], abs=1e-4) and x[0][1] == y[0][1]
    plain = responses(LatheLM(engine, *special_ids(checkpoint, engine)), tmp_path, task)
    assert plain[0][0][0][0] != pytest.approx(ours[0][0][0][0], abs=1e-3)  # it was rendered


def test_the_command_writes_results_and_refuses_a_folder_without_a_model(checkpoint, tmp_path,
                                                                         capsys):
    task = write_tasks(tmp_path)[0]
    out = tmp_path / "results.json"
    assert run_command("eval", [str(checkpoint), "--tasks", task, "--include-path",
                                str(tmp_path), "--output", str(out)]) == 0
    results = json.loads(out.read_text())["results"][task]
    assert 0 <= results["acc,none"] <= 1
    assert "acc" in capsys.readouterr().out
    assert run_command("eval", [str(tmp_path), "--tasks", task]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_the_shipped_arithmetic_task_scores_as_lathes_own_evaluation(checkpoint, monkeypatch):
    """recipes/eval/lathe_arithmetic3.yaml: the test split's first 200 problems of
    task:arithmetic3, each generation the engine's greedy reply to the question rendered
    through the chat template (lathe's own held-out evaluation's), scored by its last
    integer."""
    from lathe.data.chat_encoding import chat_encoder
    from lathe.data.tasks import task_examples
    from lathe.serve.sampling_params import SamplingParams
    root = Path(__file__).resolve().parents[2]
    shipped = [json.loads(line) for line in
               (root / "recipes/eval/arithmetic3_test.jsonl").read_text().splitlines()]
    assert shipped == [{"question": e.prompt, "answer": e.answer}
                       for e in task_examples("arithmetic3", "test", 200)]
    monkeypatch.chdir(root)  # the task's data file is relative to the repository root
    engine = LLMEngine.from_checkpoint(checkpoint)
    encoder = chat_encoder(checkpoint)
    result = lm_eval.simple_evaluate(
        model=LatheLM(engine, *special_ids(checkpoint, engine), encoder),
        tasks=["lathe_arithmetic3"],
        task_manager=task_manager(Path("recipes/eval"), ["lathe_arithmetic3"]),
        apply_chat_template=True, log_samples=True, limit=20)
    samples = sorted(result["samples"]["lathe_arithmetic3"], key=lambda s: s["doc_id"])
    prompts = [encoder.prompt([{"role": "user", "content": row["question"]}])
               for row in shipped[:20]]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [s["resps"][0][0] for s in samples] == [encoder.tokenizer.decode(
        g.outputs[0].token_ids, skip_special_tokens=True) for g in greedy]
    assert 0 <= result["results"]["lathe_arithmetic3"]["exact_match,last_integer"] <= 1


def test_the_task_index_is_the_include_paths_alone_when_it_defines_every_task(tmp_path):
    """lm-eval's own ~14,000 task files are indexed (~11 s) only when a task asked for is
    not in `--include-path`, and then its tasks are still found."""
    choice, ppl, _ = write_tasks(tmp_path)
    local = task_manager(tmp_path, [choice, ppl])
    assert sorted(local.all_tasks) == sorted([choice, "lathe_gen", ppl])
    both = task_manager(tmp_path, [choice, "hellaswag"])
    assert {choice, "hellaswag", "arc_easy"} <= set(both.all_tasks)
