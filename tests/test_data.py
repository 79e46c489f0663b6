"""qerl.data.problems: generated arithmetic, GSM8K/MATH loaders, prompts, the resumable sampler."""

from __future__ import annotations

import ast
import copy
import json
import operator
import re
from pathlib import Path

import pytest

from qerl.data.problems import (
    SYSTEM_PROMPT,
    Example,
    PromptSampler,
    arithmetic_task,
    build_prompt,
    load_dataset,
    load_jsonl,
)

DATA = Path(__file__).resolve().parents[1] / "data"  # evaluation sets the repository holds (data/README.md)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expression: str) -> int:
    """Evaluate integer + - * with usual precedence and parentheses, refusing anything else."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"unexpected syntax in {expression!r}: {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval").body)


def expression_of(example: Example) -> str:
    match = re.fullmatch(r"What is (.+)\?", example.question)
    assert match, example.question
    return match.group(1)


# --- generated arithmetic --------------------------------------------------------------------------------------------


def test_arithmetic_is_deterministic_and_prefix_stable():
    a = arithmetic_task("train", 200, seed=3)
    assert a == arithmetic_task("train", 200, seed=3)
    assert a[:50] == arithmetic_task("train", 50, seed=3)
    assert [e.question for e in a] != [e.question for e in arithmetic_task("train", 200, seed=4)]
    assert len({e.question for e in a}) == len({e.id for e in a}) == 200


def test_arithmetic_train_and_test_never_share_a_question():
    for knobs in ({}, {"digits": 1, "operators": "+-*", "steps": 2}):
        train = {e.question for seed in (0, 1) for e in arithmetic_task("train", 3000, seed=seed, **knobs)}
        test = {e.question for seed in (0, 7) for e in arithmetic_task("test", 300, seed=seed, **knobs)}
        assert len(test) > 300  # different seeds really drew different questions
        assert not train & test


@pytest.mark.parametrize(
    "knobs",
    [{}, {"digits": 1, "operators": "*", "steps": 3}, {"digits": 3, "operators": "+-*", "steps": 4}],
)
def test_arithmetic_golds_are_exact(knobs):
    for example in arithmetic_task("train", 300, seed=1, **knobs) + arithmetic_task("test", 30, seed=1, **knobs):
        assert example.gold == str(safe_eval(expression_of(example))), example
        assert example.source == "arithmetic"


def test_arithmetic_knobs_set_digits_operators_and_steps():
    for digits, operators, steps in [(1, "+", 1), (2, "-*", 2), (3, "+-*", 3)]:
        examples = arithmetic_task("train", 50, digits=digits, operators=operators, steps=steps)
        for example in examples:
            tokens = expression_of(example).replace("(", "").replace(")", "").split()
            numbers, ops = tokens[::2], tokens[1::2]
            assert len(ops) == steps and set(ops) <= set(operators)
            assert all(len(x) == digits for x in numbers)
        used = {op for e in examples for op in expression_of(e).split() if op in "+-*"}
        assert used == set(operators)


def test_arithmetic_harder_knobs_give_larger_answers():
    def mean_answer_digits(**knobs) -> float:
        examples = arithmetic_task("train", 100, **knobs)
        return sum(len(e.gold.lstrip("-")) for e in examples) / len(examples)

    default = mean_answer_digits()
    assert mean_answer_digits(digits=1) < default < mean_answer_digits(digits=3)
    assert default < mean_answer_digits(operators="+-*", steps=3)


def test_arithmetic_bad_arguments_and_exhausted_space_are_clear_errors():
    with pytest.raises(ValueError, match="operators"):
        arithmetic_task("train", 5, operators="+/")
    with pytest.raises(ValueError, match="split"):
        arithmetic_task("validation", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps"):
        arithmetic_task("train", 5, steps=0)
    # 1-digit additions: 81 questions in all, so a split cannot hold 100.
    with pytest.raises(ValueError, match=r"only \d+ distinct questions"):
        arithmetic_task("train", 100, digits=1, operators="+")


# --- GSM8K / MATH loaders --------------------------------------------------------------------------------------------


def test_load_real_gsm8k_test_file():
    examples = load_jsonl(DATA / "gsm8k" / "test.jsonl")
    assert len(examples) == 1319 and {e.source for e in examples} == {"gsm8k"}
    assert examples[0].question.startswith("Janet") and examples[0].gold == "18"
    assert examples[0].id == "gsm8k/test.jsonl:1"
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", e.gold) for e in examples)


def test_load_real_math500_file_takes_the_last_boxed_answer():
    examples = load_jsonl(DATA / "math500" / "test.jsonl")
    assert len(examples) == 500 and {e.source for e in examples} == {"math"}
    assert examples[0].gold == r"\left( 3, \frac{\pi}{2} \right)"
    # The local copy states each answer twice; the boxed one we extract must agree with "The answer is: ...".
    rows = [json.loads(line) for line in (DATA / "math500" / "test.jsonl").open()]
    assert [e.gold for e in examples] == [row["answer"].rsplit("The answer is:", 1)[1].strip() for row in rows]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_small_files_in_every_layout(tmp_path):
    gsm8k = write_jsonl(tmp_path / "g.jsonl", [{"question": "How many?", "answer": "So 1,000 + 234.\n#### 1,234"},
                                               {"question": "Owed?", "answer": "#### -5"}])
    assert [(e.question, e.gold) for e in load_jsonl(gsm8k)] == [("How many?", "1234"), ("Owed?", "-5")]

    solution = r"First $\boxed{1}$, no: $\boxed{\frac{1}{2}}$."
    local_math = write_jsonl(tmp_path / "m.jsonl", [{"question": "Q", "answer": solution}])
    assert load_jsonl(local_math)[0].gold == r"\frac{1}{2}"

    hub_math = write_jsonl(tmp_path / "h.jsonl", [{"problem": "P", "solution": r"so $\boxed{7}$", "answer": "7"}])
    assert load_jsonl(hub_math) == [Example(f"{tmp_path.name}/h.jsonl:1", "P", "7", "math")]

    # An explicit kind is enforced: a MATH file read as GSM8K has no '####'.
    with pytest.raises(ValueError, match="####"):
        load_jsonl(local_math, kind="gsm8k")


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ('{"question": "Q", "answer": "#### 2"', "invalid JSON"),
        ('["Q", "#### 2"]', "expected a JSON object"),
        ({"question": "Q"}, "missing field 'answer'"),
        ({"answer": "#### 2"}, "missing field 'question'"),
        ({"question": "Q", "answer": "  "}, "empty field 'answer'"),
        ({"question": "Q", "answer": "the answer is 2"}, "no gold answer"),
        ({"question": "Q", "answer": "####   "}, "no gold answer"),
    ],
)
def test_malformed_gsm8k_row_error_names_file_and_line(tmp_path, bad_row, message):
    good = {"question": "Q", "answer": "#### 1"}
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [good, "", good, bad_row, good])  # blank line 2 is skipped
    with pytest.raises(ValueError, match=re.escape(f"{path}:4: ") + ".*" + re.escape(message)):
        load_jsonl(path)


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"question": "Q", "answer": "no box here"}, "no gold answer"),
        ({"question": "Q", "answer": r"\boxed{}"}, "no gold answer"),
        ({"question": "Q", "answer": r"so \boxed{\frac{1}{2}"}, "no gold answer"),  # unclosed
        ({"problem": "P", "solution": r"\boxed{3}"}, "missing field 'answer'"),
        ({"question": "Q", "answer": 3}, "field 'answer' must be a string"),
    ],
)
def test_malformed_math_row_error_names_file_and_line(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "math.jsonl", [{"question": "Q", "answer": r"\boxed{1}"}, bad_row])
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: {message}")):
        load_jsonl(path)


def test_a_non_utf8_byte_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = b'{"question": "1+1?", "answer": "2 #### 2"}\n'
    path.write_bytes(good + good + b'{"question": "caf\xff?", "answer": "2 #### 2"}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not UTF-8 \(byte 0xff at byte 18 of the line\)"):
        load_jsonl(path)


def test_unrecognised_layout_asks_for_kind(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"question": "Q", "answer": "2"}])
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: ") + ".*kind="):
        load_jsonl(path)


def test_load_dataset_routes_names_and_subsamples():
    assert load_dataset("arithmetic", "train", n=20, seed=2, digits=1) == arithmetic_task("train", 20, seed=2, digits=1)
    path = DATA / "gsm8k" / "test.jsonl"
    subset = load_dataset("gsm8k", n=50, seed=1, path=str(path))
    assert subset == load_dataset(str(path), n=50, seed=1) != load_dataset("gsm8k", n=50, seed=2, path=path)
    full = load_jsonl(path)
    assert len(subset) == 50 and all(e in full for e in subset)
    assert len(load_dataset("math500", path=DATA / "math500" / "test.jsonl")) == 500
    # One config feeds every dataset: the arithmetic knobs are ignored elsewhere, misspelt ones are not.
    assert load_dataset("gsm8k", path=path, n=5, digits=3, steps=2) == load_dataset("gsm8k", path=path, n=5)
    with pytest.raises(TypeError, match="digit"):
        load_dataset("gsm8k", path=path, digit=3)
    with pytest.raises(TypeError, match="digit"):
        load_dataset("arithmetic", digit=3)
    with pytest.raises(ValueError, match="n=5000"):
        load_dataset("gsm8k", path=path, n=5000)


# --- prompts and sampling --------------------------------------------------------------------------------------------


def test_build_prompt_uses_the_chat_template(smollm2_tokenizer):
    prompt = build_prompt(smollm2_tokenizer, "What is 17 + 25?")
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>")
    assert "<|im_start|>user\nWhat is 17 + 25?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")  # generation prompt: the model answers next
    assert "\\boxed{}" in SYSTEM_PROMPT

    custom = build_prompt(smollm2_tokenizer, "What is 2 + 2?", system_prompt="Answer tersely.")
    assert custom.startswith("<|im_start|>system\nAnswer tersely.<|im_end|>") and SYSTEM_PROMPT not in custom


def test_build_prompt_falls_back_without_chat_template(smollm2_tokenizer):
    base_tokenizer = copy.deepcopy(smollm2_tokenizer)
    base_tokenizer.chat_template = None
    assert build_prompt(base_tokenizer, "What is 1 + 1?", system_prompt=None) == "Question: What is 1 + 1?\nAnswer:"
    assert build_prompt(base_tokenizer, "What is 1 + 1?") == f"{SYSTEM_PROMPT}\n\nQuestion: What is 1 + 1?\nAnswer:"


def test_sampler_covers_each_epoch_once_and_reshuffles():
    examples = arithmetic_task("train", 12)
    sampler = PromptSampler(examples, batch_size=4, seed=0)
    epochs = [[e.id for _ in range(3) for e in sampler.next_batch()] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(e.id for e in examples)
    assert epochs[0] != epochs[1]
    assert epochs[0] != [e.id for _ in range(3) for e in PromptSampler(examples, 4, seed=1).next_batch()]


def test_sampler_resumes_exactly_across_epoch_boundaries():
    examples = arithmetic_task("train", 10)
    uninterrupted = PromptSampler(examples, batch_size=4, seed=5)  # 4 does not divide 10: batches straddle epochs
    expected = [uninterrupted.next_batch() for _ in range(12)]

    first = PromptSampler(examples, batch_size=4, seed=5)
    head = [first.next_batch() for _ in range(7)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptSampler(examples, batch_size=4, seed=999)
    resumed.load_state_dict(state)
    assert head + [resumed.next_batch() for _ in range(5)] == expected

    with pytest.raises(ValueError, match="10 examples"):
        PromptSampler(examples[:9], batch_size=4).load_state_dict(state)


def test_arithmetic_without_n_takes_the_whole_small_split():
    from qerl.data.problems import load_dataset

    train = load_dataset("arithmetic", split="train", n=None, digits=1)
    test = load_dataset("arithmetic", split="test", n=None, digits=1)
    assert len(train) + len(test) == 9 * 9 * 2  # every 1-digit a+b and a-b, split by hash
    assert len(load_dataset("arithmetic", split="train", n=None)) == 1000  # larger spaces are capped
