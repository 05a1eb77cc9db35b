"""Packed SFT: best-fit decreasing fills rows without splitting an example; a packed
micro-batch gives the loss and gradients of its examples unpadded one by one (fp64), and a
mixture of experts' balance loss over their tokens alone; a packed SFT run learns, resumes
exactly and reports its sources."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.chats import Example, collate
from lathe.posttrain.packing import best_fit_decreasing, collate_packed
from lathe.posttrain.sft import sft_loss
from tests.builders import tiny_model
from tests.posttrain.conftest import quick
from tests.posttrain.test_normalization import examples


def test_best_fit_decreasing_places_every_example_once_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 64)
    placed = sorted(i for row in bins for i in row)
    assert placed == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 64 for row in bins)
    lower_bound = -(-sum(lengths) // 64)
    assert len(bins) <= 1.05 * lower_bound + 1  # BFD: within 11/9 OPT + 6/9; here ~optimal
    assert bins == best_fit_decreasing(lengths, 64)  # deterministic


def test_best_fit_takes_the_fullest_row_that_fits():
    # 6 goes beside 4 (room 6, exactly full) rather than beside 3 (room 7)
    assert best_fit_decreasing([7, 4, 3, 6], 10) == [[0, 2], [3, 1]]
    with pytest.raises(ValueError, match="an example of 11 tokens cannot be packed into rows "
                                         "of 10"):
        best_fit_decreasing([3, 11], 10)


def test_collated_rows_hold_documents_and_ignore_each_first_label():
    rows = [[Example([5, 6, 7], [-100, 6, 7]), Example([8, 9], [8, 9])], [Example([4], [4])]]
    batch = collate_packed(rows, pad_token=0, device=torch.device("cpu"))
    assert batch["ids"].tolist() == [[5, 6, 7, 8, 9], [4, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100] * 5]
    assert batch["documents"].tolist() == [[0, 0, 0, 1, 1], [0, 2, 2, 2, 2]]
    assert batch["lengths"] == [3, 2, 1]


def test_packed_micro_batch_equals_the_examples_unpadded_one_by_one():
    """Loss and every gradient in fp64 ≤ 1e-6: the loss stays the mean over the batch's
    assistant tokens, packed or not."""
    rows = [Example(*row) for row in examples(8)]
    model = tiny_model(n_layers=2).double().train()
    packed_rows = [[rows[i] for i in row]
                   for row in best_fit_decreasing([len(e.ids) for e in rows], 64)]
    assert len(packed_rows) < len(rows)
    batch = collate_packed(packed_rows, 0, torch.device("cpu"))
    loss, _ = sft_loss(model, batch)
    loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    tokens = [sum(label != IGNORE_INDEX for label in e.labels[1:]) for e in rows]
    expected = 0.0
    for example, count in zip(rows, tokens, strict=True):
        one, _ = sft_loss(model, collate([example], 0, torch.device("cpu")))
        weighted = one * count / sum(tokens)
        weighted.backward()
        expected += float(weighted.detach())
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed[name], param.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_a_packed_batchs_balance_loss_counts_its_examples_tokens_alone():
    """The routing of packed rows, padded to the longest, is counted over their examples'
    tokens: the balance loss equals that of the same examples back to back in one row with
    no padding (TRL's padding-free packing), which the pads would change."""
    rows = [Example(*row) for row in examples(8)]
    model = tiny_model(n_layers=2, family="qwen3_moe", n_experts=4, n_experts_per_token=2,
                       moe_ffn_hidden_dim=32).double()
    packed_rows = [[rows[i] for i in row]
                   for row in best_fit_decreasing([len(e.ids) for e in rows], 64)]
    batch = collate_packed(packed_rows, 0, torch.device("cpu"))
    assert (batch["ids"] == 0).any()  # some row is padded
    flat = collate_packed([[e for row in packed_rows for e in row]], 0, torch.device("cpu"))
    assert not (flat["ids"] == 0).any()
    with torch.no_grad():
        _, packed = sft_loss(model, batch)
        _, unpadded = sft_loss(model, flat)
        padded = model(batch["ids"], labels=batch["labels"], documents=batch["documents"])
    assert float(packed["router/aux_loss"]) == pytest.approx(
        float(unpadded["router/aux_loss"]), abs=1e-9)
    assert abs(float(padded.router.aux_loss) - float(unpadded["router/aux_loss"])) > 1e-6


def varied_chats(path: Path, count: int = 96) -> Path:
    """Chats whose lengths vary about tenfold, as real chat data does."""
    rng = random.Random(0)
    lines = []
    for i in range(count):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        padding = " ".join(["please"] * rng.choice([0, 0, 1, 3, 12]))
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": f"{padding} What is {a} + {b}?".strip()},
            {"role": "assistant", "content": f"{a + b}" + " ok" * (i % 4)}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_packed_sft_learns_and_resumes_exactly(base, tmp_path, capsys):
    """Over several epochs of rows (96 chats packed into a few rows of 96 tokens)."""
    chats = varied_chats(tmp_path / "chats.jsonl")
    settings = {"data.train": chats, "data.eval": chats, "data.packing": "true",
                "data.max_len": 96, "micro_batch_size": 4, "optim.lr": 3e-3,
                "eval.every": 12, "checkpoint.every": 6}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["sft", *quick(whole, base, max_steps=12, **settings)]) == 0
    result = summary(whole)
    assert result["heldout_loss"][-1] < 0.8 * result["heldout_loss"][0]
    printed = capsys.readouterr().out
    assert "packing: 96 chats into" in printed and "rows of up to 96 tokens" in printed
    (resumed / "state").mkdir(parents=True)
    shutil.copytree(whole / "state" / "step-00000006", resumed / "state" / "step-00000006")
    assert main(["sft", *quick(resumed, base, max_steps=12, **settings), "--resume",
                 "auto"]) == 0
    assert summary(resumed)["heldout_loss"] == pytest.approx(result["heldout_loss"], abs=1e-6)
    tally = result["sources"][str(chats)]
    assert summary(resumed)["sources"] == result["sources"]
    assert tally["examples"] > 96  # more than one epoch, counted across the resume


def test_sft_on_a_weighted_mixture_reports_what_each_source_gave(base, tmp_path, capsys):
    chats = varied_chats(tmp_path / "chats.jsonl")
    mixture = f"[{{source: 'task:arithmetic', weight: 3}}, {{source: '{chats}', weight: 1}}]"
    out = tmp_path / "mixed"
    assert main(["sft", *quick(out, base, max_steps=4, micro_batch_size=4, **{
        "data.train": mixture, "data.limit": 64, "data.packing": "true",
        "data.max_len": 96})]) == 0
    printed = capsys.readouterr().out
    assert "mixture: task:arithmetic 75.0% (48 of " in printed
    assert f"{chats} 25.0% (16 of 96)" in printed
    assert "trained on: task:arithmetic " in printed
    sources = summary(out)["sources"]
    assert set(sources) == {"task:arithmetic", str(chats)}
    assert all(entry["tokens"] > 0 for entry in sources.values())


def test_too_few_rows_for_a_step_name_the_packing(base, tmp_path, capsys):
    assert main(["sft", *quick(tmp_path / "few", base, max_steps=2, micro_batch_size=8, **{
        "data.limit": 16, "data.packing": "true"})]) == 2
    assert ("data.packing=true: 16 chats pack into 3 rows of data.max_len=128, fewer than one "
            "step of micro_batch_size=8 rows") in capsys.readouterr().err
