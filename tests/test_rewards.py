"""Reward functions: grading table, real GSM8K / MATH-500 gold, hostile inputs, registry."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qerl.data.rewards import (
    REWARDS,
    combined_reward,
    extract_answer,
    format_reward,
    get_reward_fn,
    normalize_answer,
    score,
)

DATA = Path(__file__).resolve().parents[1] / "data"  # evaluation sets the repository holds (data/README.md)


def my_reward(completion: str, gold: str) -> float:
    """A user reward for the registry tests: 0.5 per mention of 'qerl'."""
    return 0.5 * completion.count("qerl")


not_callable_reward = 3


@pytest.fixture(autouse=True)
def _grader_ready():
    """math-verify's worker is loaded before each test (a no-op when it is): a hostile case that killed one must not
    make the next test's legitimate answer miss its deadline while the replacement loads."""
    from qerl import grading

    grading.start_worker(wait=True)

# (completion, gold, expected score)
CASES = [
    # --- extraction: boxed, fbox, nested braces, answer phrases, ####, last number
    ("so we get $\\boxed{72}$.", "72", 1),
    ("first \\boxed{5}, corrected: \\boxed{7}", "7", 1),
    ("first \\boxed{5}, corrected: \\boxed{7}", "5", 0),
    ("\\fbox{12}", "12", 1),
    ("$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt3}{2}", 1),
    ("\\boxed 5", "5", 1),
    ("The answer is 42.", "42", 1),
    ("Answer: 42", "42", 1),
    ("The final answer is: $\\frac{1}{2}$.", "0.5", 1),
    ("The answer is 18 dollars because she sells 9 eggs.", "18", 1),
    ("#### 72", "72", 1),
    ("She pays 3 + 4 = 7 dollars in total.", "7", 1),
    ("She has 5 apples, then buys 3 more for a total of 8", "8", 1),
    ("the answer is not 5... the answer is 6", "6", 1),
    ("the answer is not 5... the answer is 6", "5", 0),
    ("The answer is not 5.", "5", 0),
    ("I computed 5, so the answer is 5. #### 6", "6", 1),
    ("no numbers here", "3", 0),
    ("\\boxed{}", "0", 0),
    ("Final Answer: The final answer is $18$. I hope it is correct.", "18", 1),
    ("**Answer:** 18", "18", 1),
    ("The answer is:\n\n$$\\frac{3}{4}$$", "0.75", 1),
    ("The answer is 5, since 2 + 3 = 5 and not 6", "5", 1),
    ("It drops from 12 to x - 5", "5", 1),
    # --- numbers: commas, $, %, units, trailing zeros, fractions for decimals
    ("\\boxed{1,000}", "1000", 1),
    ("\\boxed{1{,}000}", "1000", 1),
    ("\\boxed{10,\\!080}", "10080", 1),
    ("The answer is $70,000.", "#### 70000", 1),
    ("\\boxed{\\$18.90}", "18.9", 1),
    ("\\boxed{10\\%}", "10", 1),
    ("The answer is 25%.", "25", 1),
    ("\\boxed{5.4 \\text{ cents}}", "5.4", 1),
    ("\\boxed{864 \\mbox{ inches}^2}", "864", 1),
    ("\\boxed{12 cm}", "12", 1),
    ("\\boxed{5.00}", "5", 1),
    ("\\boxed{2.50}", "2.5", 1),
    ("\\boxed{0.5}", "\\frac12", 1),
    ("\\boxed{1/2}", "0.5", 1),
    ("\\boxed{.5}", "1/2", 1),
    ("\\boxed{-3}", "-3", 1),
    ("\\boxed{1.25}", "\\frac{5}{4}", 1),
    ("\\boxed{1\\frac{4}{5}}", "\\frac95", 1),
    ("\\boxed{137 \\frac{1}{2}}", "275/2", 1),
    ("\\boxed{0.333}", "\\frac13", 0),
    ("\\boxed{72}", "720", 0),
    ("\\boxed{720}", "72", 0),
    ("\\boxed{\\frac{1}{2}}", "2", 0),
    ("\\boxed{-5}", "5", 0),
    ("\\boxed{100000000000000000001}", "100000000000000000000", 0),
    # --- symbolic
    ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", 1),
    ("\\boxed{\\tfrac{14}{3}}", "14/3", 1),
    ("\\boxed{\\sqrt{117}}", "3\\sqrt{13}", 1),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1),
    ("\\boxed{\\sqrt{8}}", "3\\sqrt{2}", 0),
    ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{1}{\\sqrt{3}}", 1),
    ("\\boxed{11\\sqrt2}", "11\\sqrt{2}", 1),
    ("\\boxed{\\sqrt[3]{8}}", "2", 1),
    ("\\boxed{2^{10}}", "1024", 1),
    ("\\boxed{3^3=27}", "27", 1),
    ("\\boxed{\\pi}", "3.14159", 0),
    # A decimal that agrees to 6 decimal places is equal (math-verify's float_rounding; its suite: sqrt(17) = 4.1231056...)
    ("\\boxed{2\\pi}", "6.283185307179586", 1),
    ("\\boxed{2\\pi}", "6.2832", 0),
    ("\\boxed{\\sqrt{2}\\cdot 10^{30} + 1}", "\\sqrt{2}\\cdot 10^{30}", 0),
    ("\\boxed{\\sin(\\pi/12)}", "\\frac{\\sqrt6-\\sqrt2}{4}", 1),
    ("\\boxed{\\sqrt{2}+\\sqrt{3}}", "\\sqrt{5+2\\sqrt6}", 1),
    ("\\boxed{x^{1000}}", "x^{1000}+1", 0),
    ("\\boxed{\\frac{x^2-1}{x-1}}", "x+1", 1),
    ("\\boxed{2x}", "2y", 0),
    ("\\boxed{6 - 5i}", "6-5i", 1),
    ("\\boxed{-5i + 6}", "6-5i", 1),
    ("\\boxed{5!}", "120", 1),
    ("\\boxed{\\binom{5}{2}}", "10", 1),
    ("\\boxed{p - q}", "-q + p", 1),
    ("\\boxed{(a+5)(b+2)}", "ab + 2a + 5b + 10", 1),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1),
    ("\\boxed{x^2 + 2x + 2}", "(x+1)^2", 0),
    ("\\boxed{\\cot x}", "\\frac{\\cos x}{\\sin x}", 1),
    ("\\boxed{\\frac{11+9a}{20}}", "0.55 + 0.45a", 1),
    ("\\boxed{\\log_2 8}", "3", 1),
    ("\\boxed{|-3|}", "3", 1),
    ("\\boxed{e^{i\\pi}}", "-1", 1),
    # --- degrees, assignments, text, multiple choice
    ("\\boxed{90^\\circ}", "90", 1),
    ("\\boxed{90^{\\circ}}", "90^\\circ", 1),
    ("\\boxed{30 degrees}", "30^\\circ", 1),
    ("\\boxed{x = 4}", "4", 1),
    ("\\boxed{4}", "x=4", 1),
    ("\\boxed{y = 2x + 3}", "2x+3", 1),
    ("\\boxed{\\text{(B)}}", "\\text{(B)}", 1),
    ("The answer is (B).", "\\text{(B)}", 1),
    ("\\boxed{B}", "(B)", 1),
    ("\\boxed{\\text{(C)}}", "\\text{(B)}", 0),
    ("\\boxed{\\textbf{(C)}\\ 12}", "\\text{(C)}", 1),
    ("\\boxed{\\textbf{(C)}\\ 12}", "\\text{(B)}", 0),
    ("\\boxed{\\text{East}}", "\\text{east}", 1),
    ("\\boxed{east}", "\\text{ east }", 1),
    ("\\boxed{\\text{west}}", "\\text{east}", 0),
    ("\\boxed{\\text{Evelyn}}", "Evelyn", 1),
    ("\\boxed{52_8}", "52_{8}", 1),
    ("\\boxed{52_8}", "52", 1),  # the subscript names the base the question asked for (math-verify agrees)
    ("\\boxed{52_8}", "53", 0),
    # --- delimiters and spacing commands
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", 1),
    ("\\boxed{\\!3\\,000}", "3000", 1),
    ("\\boxed{\\displaystyle \\frac{3}{2}}", "1.5", 1),
    # --- tuples, intervals, sets, unions, matrices, \pm
    ("\\boxed{(1,2)}", "(1, 2)", 1),
    ("\\boxed{(1,2)}", "(2,1)", 0),
    ("\\boxed{(1,2)}", "[1,2]", 0),
    ("\\boxed{(0.5, -2)}", "\\left(\\frac12, -2\\right)", 1),
    ("\\boxed{[2, 5)}", "[2,5)", 1),
    ("\\boxed{[2,5)}", "[2,5]", 0),
    ("\\boxed{(-\\infty, 0]}", "(-\\infty,0]", 1),
    ("\\boxed{x \\in [-2,7]}", "[-2,7]", 1),
    ("\\boxed{(-\\infty, 2) \\cup (3, \\infty)}", "(3,\\infty)\\cup(-\\infty,2)", 1),
    ("\\boxed{(-\\infty, 2) \\cup (3, \\infty)}", "(-\\infty,2]\\cup(3,\\infty)", 0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1),
    ("\\boxed{\\{1,2\\}}", "\\{1,3\\}", 0),
    ("\\boxed{3, 5, 7}", "7,3,5", 1),
    ("\\boxed{3, 5}", "3, 5, 7", 0),
    ("\\boxed{-2, 1}", "1,-2", 1),
    ("\\boxed{1 \\pm \\sqrt{19}}", "1+\\sqrt{19}, 1-\\sqrt{19}", 1),
    ("\\boxed{1 \\pm \\sqrt{19}}", "1+\\sqrt{19}", 0),
    ("\\boxed{x = \\pm 3}", "3, -3", 1),
    ("\\boxed{\\{-2, 1+\\sqrt5, 1-\\sqrt5\\}}", "\\{1\\pm\\sqrt{5},-2\\}", 1),
    ("\\boxed{\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}}", "\\begin{pmatrix} 0.2 \\\\ -3.6 \\end{pmatrix}", 1),
    ("\\boxed{\\begin{pmatrix} -18/5 \\\\ 1/5 \\end{pmatrix}}", "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", 0),
    (  # same entries, different shape
        "\\boxed{\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}}",
        "\\begin{pmatrix} 1 \\\\ 0 \\\\ 0 \\\\ 1 \\end{pmatrix}",
        0,
    ),
    # --- GSM8K and MATH gold solutions
    ("So he made a profit of $70,000.", "He makes 200,000-130,000=$<<200000-130000=70000>>70,000\n#### 70000", 1),
    ("The answer is 18", "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18", 1),
    ("The answer is 9", "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18", 0),
    ("We get \\boxed{\\frac{14}{3}}.", "$=\\boxed{\\frac{14}{3}}$The answer is: \\frac{14}{3}", 1),
    ("We get \\boxed{\\frac{14}{3}}.", "$=\\boxed{\\frac{14}{3}}$The answer is: \\frac{14}{3}", 1),
    ("We get \\boxed{4.67}.", "$=\\boxed{\\frac{14}{3}}$The answer is: \\frac{14}{3}", 0),
]


@pytest.mark.parametrize("completion, gold, expected", CASES)
def test_score_table(completion: str, gold: str, expected: int) -> None:
    assert score(completion, gold) == expected  # math-verify's budget is CPU time: a loaded machine cannot flip it


def test_score_is_symmetric_in_gold_form() -> None:
    """A bare gold and the same gold inside a solution grade identically."""
    for completion in ("\\boxed{\\frac{14}{3}}", "\\boxed{3}", "\\boxed{(1,2)}"):
        assert score(completion, "\\frac{14}{3}") == score(completion, "so $\\boxed{\\frac{14}{3}}$.")


def test_extract_answer() -> None:
    assert extract_answer("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_answer("x \\boxed{3") is None  # unclosed final box: no answer, no fallback
    assert extract_answer("blah\n#### 1,234\n") == "1,234"
    point = "$\\left( 3, \\frac{\\pi}{2} \\right)$"
    assert extract_answer(f"The answer is {point}, as shown.") == point
    assert extract_answer("it costs 3 then 4.5 dollars") == "4.5"
    assert extract_answer("nothing") is None


def test_normalize_answer() -> None:
    assert normalize_answer("\\$1,000.") == "1000"
    assert normalize_answer("\\text{(B)}") == "B"
    assert normalize_answer("x = \\dfrac{1}{2}") == "\\frac{1}{2}"
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"


def _rows(name: str, n: int = 50) -> list[dict]:
    with (DATA / name / "test.jsonl").open() as f:  # part of the repository: missing is a failure, not a skip
        return [json.loads(line) for _, line in zip(range(n), f)]


def test_gsm8k_gold_solutions_score_themselves() -> None:
    for row in _rows("gsm8k"):
        solution = row["answer"]
        final = solution.rsplit("####", 1)[1].strip()
        assert extract_answer(solution) == final
        assert score(solution, solution) == 1.0
        assert score(f"Step by step... so the answer is {final}.", solution) == 1.0
        assert score(f"So the answer is {final}1.", solution) == 0.0


def test_math500_gold_solutions_score_themselves() -> None:
    """The last box of every solution must equal its stated "The answer is: ..." line."""
    for row in _rows("math500"):
        solution = row["answer"]
        final = solution.rsplit("The answer is:", 1)[1].strip()
        assert score(solution, solution) == 1.0, final
        assert score(f"Thus $\\boxed{{{final}}}$.", solution) == 1.0, final
        assert score("Thus $\\boxed{123456789}$.", solution) == 0.0, final


HOSTILE = [
    "The answer is \\boxed{72",
    "\\boxed{" + "9" * 20_000 + "}",
    "9" * 20_000,
    "\\boxed{2^2^2^2^2^2^2}",
    "\\boxed{9^9^9^9}",
    "\\boxed{(10^{100})^{10^{3}}}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{" + "(" * 3000 + "72" + ")" * 3000 + "}",
    "\\boxed{" + "{" * 3000 + "72" + "}" * 3000 + "}",
    "\\boxed{" + "\\sqrt{" * 500 + "72" + "}" * 500 + "}",
    "x" * 1_000_000,
    "\\boxed{" * 150_000,
    "the answer is " * 70_000,
    "1," * 500_000,
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{0^{-1}}",
    "\\boxed{\\infty - \\infty}",
    "\\boxed{NaN}",
    "\\boxed{nan}",
    "\\boxed{inf}",
    "\\boxed{1e999}",
    "\\boxed{1000!}",
    "\\boxed{\\binom{100000}{50000}}",
    "\\boxed{\\sin(10^{100})}",
    "\\boxed{\\frac{}{}}",
    "\\boxed{}}}}{{{",
    "\\boxed{\\\\\\\\}",
    "$$$$\\(\\)\\[\\]",
    "",
    "\\boxed" + " " * 1_000_000 + "{7}",
    "a \\boxed{" + "{}" * 500_000 + "}",
    "\\boxed{" + ",".join(f"\\sin(x_{i % 8})+{i}" for i in range(40)) + "}",
    "\\boxed{" + "\\frac" * 200 + "}",
    "\\boxed{" + "-" * 300 + "1}",
    "\\boxed{(x^{10000})^{10000}}",
]


@pytest.mark.parametrize("completion", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_hostile_completions_score_zero_fast(completion: str) -> None:
    for gold in ("72", "\\frac{14}{3}", "x^2+1"):
        start = time.perf_counter()
        assert score(completion, gold) == 0.0
        assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    format_reward(completion)
    assert time.perf_counter() - start < 1.0


def test_large_unordered_answers_stay_bounded() -> None:
    """50-item answers that need symbolic matching cost qerl's own equality a bounded number of comparisons (what it
    cannot decide goes to math-verify, bounded by its CPU budget: tests/test_grading.py)."""
    from qerl.grading.equality import own_verdict

    pred = ",".join(f"x+{i}" for i in range(50))
    start = time.perf_counter()
    assert score(f"\\boxed{{{pred}}}", ",".join(f"x+{i}" for i in reversed(range(50)))) == 1.0
    assert own_verdict(pred, ",".join(f"{i}+y" for i in range(50))) is None
    assert time.perf_counter() - start < 2.0


def test_score_works_off_the_main_thread() -> None:
    """Trainers grade in worker threads, where signal-based timeouts are unavailable."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [("\\boxed{\\sqrt{117}}", "3\\sqrt{13}"), ("\\boxed{9^9^9^9}", "72")] * 4
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda job: score(*job), jobs)) == [1.0, 0.0] * 4


def test_score_never_raises_on_bad_types() -> None:
    assert score(None, "72") == 0.0  # type: ignore[arg-type]
    assert score("\\boxed{72}", None) == 0.0  # type: ignore[arg-type]


FORMAT_CASES = [
    ("First, 16 - 3 - 4 = 9 eggs remain; 9 * 2 = 18. So the answer is $\\boxed{18}$.", 1),
    ("Reasoning about the problem carefully.\n\\[\\boxed{\\frac{1}{2}}\\]", 1),
    ("\\boxed{18}", 0),  # no reasoning
    ("We compute 9 * 2 = 18 dollars in total: \\boxed{18} and then more text follows", 0),
    ("We compute 9 * 2 = 18 dollars in total: \\boxed{18}. Also \\boxed{19}", 0),  # two answers
    ("We compute 9 * 2 = 18 dollars in total: the answer is 18.", 0),  # no box
    ("We compute 9 * 2 = 18 dollars in total: \\boxed{18", 0),  # unclosed
    ("We compute 9 * 2 = 18 dollars in total: \\boxed{ }", 0),  # empty
]


@pytest.mark.parametrize("completion, expected", FORMAT_CASES)
def test_format_reward(completion: str, expected: int) -> None:
    assert format_reward(completion) == expected
    assert format_reward(completion, "ignored gold") == expected


def test_registry_builtins_and_custom_spec() -> None:
    assert REWARDS["accuracy"] is score and REWARDS["format"] is format_reward
    assert get_reward_fn("accuracy") is score
    assert get_reward_fn("tests.test_rewards:my_reward") is my_reward
    assert get_reward_fn("tests.test_rewards:my_reward")("qerl qerl", "") == 1.0


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("no_such_reward", "unknown reward"),
        ("tests.no_such_module:fn", "cannot import module"),
        ("tests.test_rewards:no_such_fn", "has no attribute"),
        ("tests.test_rewards:not_callable_reward", "not callable"),
        ("tests.test_rewards:", "unknown reward"),
    ],
)
def test_bad_reward_spec_raises_naming_it(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as err:
        get_reward_fn(spec)
    assert repr(spec) in str(err.value)


def test_combined_reward_is_weighted_sum() -> None:
    reward = combined_reward({"accuracy": 1.0, "format": 0.25, "tests.test_rewards:my_reward": 2.0})
    good = "Nine eggs at two dollars each make 18 dollars. qerl $\\boxed{18}$"
    assert reward(good, "#### 18") == pytest.approx(1.0 + 0.25 + 2.0 * 0.5)
    assert reward("\\boxed{17}", "#### 18") == 0.0
    with pytest.raises(ValueError, match="no_such_reward"):
        combined_reward({"accuracy": 1.0, "no_such_reward": 1.0})
    with pytest.raises(ValueError):
        combined_reward({})
