"""Prompts longer than the model's context minus max_new_tokens are caught when the data loads, naming file and line."""

import json
import logging
import time
from pathlib import Path

import pytest

from tests.test_trainer import make_trainer, tiny_settings

REPO = Path(__file__).resolve().parent.parent


def write_rows(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": f"x #### {i}"}) + "\n"
                            for i, q in enumerate(questions)))
    return path


def test_an_overlong_prompt_is_rejected_naming_file_line_and_length(tmp_path):
    # the tiny model's context is 256 tokens, 6 of them for the completion; one character is one token
    rows = write_rows(tmp_path / "rows.jsonl", ["1+1?", "2" * 250, "3+3?"])
    settings = tiny_settings(tmp_path, data={"name": str(rows), "n": None})
    with pytest.raises(ValueError) as info:
        make_trainer(settings, tmp_path / "run")
    assert str(info.value) == (f"{rows}:2: prompt is 251 tokens, longer than the 250 the model's context of 256 "
                               "leaves after rollout.max_new_tokens = 6 (shorten it, or set "
                               "data.overlong_prompts=drop to leave such examples out)")
    fits = write_rows(tmp_path / "fits.jsonl", ["1+1?", "2" * 249])  # 250 tokens: exactly fits
    with make_trainer(tiny_settings(tmp_path, data={"name": str(fits), "n": None}), tmp_path / "ok") as trainer:
        assert len(trainer.sampler.examples) == 2


def test_drop_leaves_overlong_examples_out_and_counts_them(tmp_path, caplog):
    rows = write_rows(tmp_path / "rows.jsonl", ["1+1?", "2" * 300, "3+3?", "4" * 400])
    settings = tiny_settings(tmp_path, data={"name": str(rows), "n": None, "overlong_prompts": "drop"})
    with caplog.at_level(logging.WARNING), make_trainer(settings, tmp_path / "run") as trainer:
        assert [ex.question for ex in trainer.sampler.examples] == ["1+1?", "3+3?"]
    assert f"dropped 2 of 4 examples of {rows} whose prompt is longer than 250 tokens" in caplog.text


def test_max_new_tokens_filling_the_context_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="rollout.max_new_tokens = 256 leaves no room for a prompt in the model's "
                                         "context of 256 tokens"):
        make_trainer(tiny_settings(tmp_path, rollout={"max_new_tokens": 256}), tmp_path / "run")


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_huge_question_fails_in_one_line_before_the_model_loads(tmp_path, command, qerl_here):
    rows = write_rows(tmp_path / "big.jsonl", ["What is 1 + 1?", "What is " + "9 + " * 150_000 + "1?"])  # 600 KB
    key = "data" if command == "train" else "eval"
    start = time.perf_counter()
    code, _, err = qerl_here(command, "--params", "params/tiny.yaml", "--out", tmp_path / "out",
                             "-S", f"{key}.name={rows}", "-S", f"{key}.n=null")
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"qerl: error: {rows}:2: prompt is ") and "longer than the " in line
    assert ("rollout" if command == "train" else "eval") + ".max_new_tokens = 16" in line
    assert "loaded" not in err  # the model never loaded
    assert time.perf_counter() - start < 120
