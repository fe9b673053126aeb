"""bin/eval: the task set's scoring, and the real default model through a server answering every
item as transformers does on the same file (tokens and verdicts, item by item)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor_tools.eval.tasks import Item, tasks

REPO = Path(__file__).resolve().parents[2]


def test_the_task_set_has_100_items_of_four_kinds() -> None:
    items = tasks()
    assert len(items) == 100 and len({i.id for i in items}) == 100
    assert {c: sum(i.category == c for i in items) for c in {i.category for i in items}} == {
        "arithmetic": 30, "capitals": 30, "completions": 20, "format": 20,
    }  # fmt: skip


@pytest.mark.parametrize(
    "match, answer, reply, right",
    [
        ("number", "5", "2 + 3 = 5", True),
        ("number", "42", "1 times 42 is 43.", False),  # the operand is not the answer
        ("number", "12", "It is 12.", True),
        ("contains", "Paris", "The capital of France is paris.", True),
        ("contains", "Rome", "Romeo", False),
        ("contains", "Buenos Aires", "It is Buenos Aires.", True),
        ("exact", "YES", " YES! ", True),
        ("exact", "YES", "Yes", False),
        ("exact", "hello world", "hello world, friend", False),
    ],
)
def test_scoring(match, answer, reply, right) -> None:
    assert Item("x", "c", "q", answer, match).correct(reply) is right


def test_the_real_model_answers_each_item_as_transformers(tmp_path) -> None:
    from conveyor.checkpoints.gguf.default_model import FetchError, default_model_file

    try:
        default_model_file()
    except FetchError as exc:
        pytest.skip(f"the default model cannot be fetched here: {exc}")
    out = tmp_path / "eval.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bin" / "eval"), "--limit", "1", "--max-tokens", "12", "--hf", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["accuracy"]["all"][1] == 4 and report["items_differing_from_hf"] == 0
    assert all(row["tokens_equal"] and row["correct"] == row["hf_correct"] for row in report["items"])
    paris = next(row for row in report["items"] if row["id"] == "capitals-00")
    assert paris["correct"] and "Paris" in paris["reply"]
    assert "transformers" in done.stdout and "all" in done.stdout
