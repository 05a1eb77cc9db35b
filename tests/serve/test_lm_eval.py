"""lm-evaluation-harness scores a multiple-choice task through the server (its
`local-completions` model, which reads prompt log-probs from `echo`) exactly as it scores
the same checkpoint loaded in `transformers` (its `hf` model)."""

from __future__ import annotations

import json
import random

import pytest

from lathe.serve.evaluate import task_manager
from tests.serve.conftest import start_server, wait_healthy

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow


def write_task(folder) -> str:
    rng = random.Random(0)
    subjects = ["The river", "The old mill", "A quiet town", "The garden", "The bridge"]
    verbs = [" ran past", " stood near", " looked at", " waited by"]
    objects = [" the mill", " the sea", " a house", " the hills", " the road", " the church"]
    with open(folder / "items.jsonl", "w") as f:
        for _ in range(16):
            f.write(json.dumps({"question": rng.choice(subjects) + rng.choice(verbs),
                                "choices": rng.sample(objects, 3),
                                "answer": rng.randrange(3)}) + "\n")
    (folder / "lathe_mc.yaml").write_text(f"""task: lathe_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "items.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return "lathe_mc"


def scores(model: str, model_args: str, folder, task: str) -> list:
    result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                     task_manager=task_manager(folder, [task]),
                                     log_samples=True, batch_size=1)
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in samples]


def test_local_completions_through_the_server_scores_as_hf_does(checkpoint, tmp_path):
    task = write_task(tmp_path)
    direct = scores("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", tmp_path, task)
    server, thread, url = start_server(checkpoint)
    try:
        wait_healthy(url)
        served = scores("local-completions",
                        f"model=tiny,base_url={url}/v1/completions,tokenizer={checkpoint},"
                        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
                        tmp_path, task)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert len(served) == len(direct) == 16
    for ours, theirs in zip(served, direct, strict=True):
        for (loglik, greedy), (expected, expected_greedy) in zip(ours, theirs, strict=True):
            assert loglik == pytest.approx(expected, abs=1e-3)
            assert loglik < -1.0  # a real score, not the 0 an ignored echo gives
            assert greedy == expected_greedy
