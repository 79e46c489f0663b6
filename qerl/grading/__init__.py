r"""Grading a model's answer against a gold answer: qerl's extraction, qerl's fast equality, math-verify's equivalence.

`grade(completion, gold)` runs three steps:
  1. extraction (qerl.grading.extract): the final answer of the completion and of the gold, by one documented rule
     (the last group of boxes, else an "answer is" / `####` marker, else the last math span or number);
  2. qerl's own bounded equality (qerl.grading.equality), in process: exact text, numbers as exact fractions,
     tuples/sets/intervals/matrices, a bounded symbolic check. It decides most answers in microseconds: equal, or
     surely different (two plain numbers or words);
  3. otherwise HuggingFace math-verify (`verify(parse(gold), parse(answer))`, pinned in pyproject.toml) in a worker
     process under a CPU-time budget (qerl.grading.mathverify): relations (`-x > -1` = `x < 1`), labelled golds
     (`(p,q)=(3,2)`), equations of curves, sets vs inequalities, and whatever LaTeX qerl's parser does not read.

The answer is right if step 2 or step 3 finds it equal. A completion whose comparison needs more than CPU_BUDGET_S
seconds of the worker's CPU (hostile text, an expression sympy cannot finish) is scored 0 and counted in
`stats()["timeouts"]`. The budget is CPU time, not wall time, so a score depends on the completion and the gold only:
not on the machine's load, nor on what was graded before. This package owns the rule of what counts as the same
answer; `qerl.data.rewards` and `qerl.evaluation` score with it.

May import: qerl (its version only).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from qerl.grading.equality import own_verdict
from qerl.grading.extract import extract_answer, final_answers, gold_answer
from qerl.grading.mathverify import MathVerify, MathVerifyPool
from qerl.grading.normalize import normalize_answer
from qerl.grading.symbolic import too_large

__all__ = ["Grade", "grade", "grade_all", "grader_info", "stats", "start_worker", "extract_answer", "gold_answer",
           "normalize_answer"]

GRADER = "qerl.grading"
# Bump when a change of the rule (not a bug fix) changes scores: 1 was qerl's grader before #29; 3 (#47) takes the
# last box after a retraction, lists of math spans, percent against share, named values by name.
RULE_VERSION = 3
# math-verify's CPU time per graded completion (the worker's own, measured there; waiting is not counted). The
# slowest legitimate case of tests/grading_cases/ needs 0.76 s; a loaded machine stretches CPU time a little (shared
# caches): 2 s keeps every case well inside, and a hostile answer costs at most that.
CPU_BUDGET_S = 2.0

# What math-verify never gets: it would only spend its CPU budget on it (sympy on a power tower, a huge literal).
_TOWER_RE = re.compile(r"\^\s*\{?\s*[\d\w]+\s*\}?\s*\^")
_LONG_LITERAL_RE = re.compile(r"\d{40}")
_HUGE_COMBINATORICS_RE = re.compile(r"\d{4,}\s*!|\\[dt]?binom\s*\{?\s*\d{4,}")  # 1000!, \binom{10000}{..}
MAX_MATHVERIFY_CHARS = 300
MAX_MATHVERIFY_BRACE_DEPTH = 12

_mathverify: MathVerify | MathVerifyPool = MathVerifyPool()
_stats_lock = threading.Lock()
_stats = {"graded": 0, "own": 0, "math_verify": 0, "timeouts": 0}


@dataclass(frozen=True)
class Grade:
    score: float  # 1.0 right, 0.0 wrong
    answer: str | None  # the completion's final answer as extracted (None: it gave none)
    gold: str | None  # the gold's final answer as extracted
    decided_by: str  # "no answer", "qerl", "math-verify", "refused" (too large for math-verify), "timeout" (over
    # math-verify's CPU budget)

    @property
    def timed_out(self) -> bool:
        return self.decided_by == "timeout"


def _brace_depth(s: str) -> int:
    depth = deepest = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        deepest = max(deepest, depth)
    return deepest


def _fit_for_mathverify(s: str) -> bool:
    return (len(s) <= MAX_MATHVERIFY_CHARS and not _TOWER_RE.search(s) and not _LONG_LITERAL_RE.search(s)
            and not _HUGE_COMBINATORICS_RE.search(s) and _brace_depth(s) <= MAX_MATHVERIFY_BRACE_DEPTH
            and not too_large(normalize_answer(s)))


def _as_latex(answer: str) -> str:
    """An extracted answer as math-verify's `parse` reads it: inside `$...$` unless it has its own delimiters."""
    return answer if re.search(r"\$|\\\(|\\\[|\\boxed", answer) else f"${answer}$"


def _count(key: str) -> None:
    with _stats_lock:
        _stats[key] += 1


def grade(completion: str, gold: str, cpu_budget_s: float | None = None) -> Grade:
    """Grade `completion` against `gold` (a bare answer or a worked solution). Never raises. math-verify, where it is
    needed, gets `cpu_budget_s` seconds of its worker's CPU (default CPU_BUDGET_S); the wall time that takes grows
    with the machine's load, and the first request also waits for the worker to load (~2 s of CPU, once)."""
    _count("graded")
    try:
        answers, target = final_answers(completion), gold_answer(gold)
    except Exception:  # noqa: BLE001 - a reward never raises
        answers, target = None, None
    answer = None if answers is None else ", ".join(answers)
    if answer is None or target is None:
        return Grade(0.0, answer, target, "no answer")
    verdict = own_verdict(answer, target)
    if verdict is not None:
        _count("own")
        return Grade(float(verdict), answer, target, "qerl")
    if not (_fit_for_mathverify(answer) and _fit_for_mathverify(target)):
        return Grade(0.0, answer, target, "refused")
    budget = CPU_BUDGET_S if cpu_budget_s is None else cpu_budget_s
    verdict, new_timeout = _mathverify.equal(_as_latex(target), _as_latex(answer), budget)
    _count("math_verify")
    if new_timeout:
        _count("timeouts")
    if verdict is None:
        return Grade(0.0, answer, target, "timeout" if _mathverify.unavailable is None else "qerl")
    return Grade(float(verdict), answer, target, "math-verify")


def grade_all(pairs: list[tuple[str, str]]) -> list[Grade]:
    """grade() of every (completion, gold), the math-verify requests in parallel over the worker pool (one thread per
    worker; qerl's own steps share the interpreter). The trainer calls it first in a step's scoring, so the rewards'
    own calls find math-verify's verdicts cached."""
    size = getattr(_mathverify, "size", 1)
    if size <= 1 or len(pairs) <= 1:
        return [grade(c, g) for c, g in pairs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=size, thread_name_prefix="qerl-grade") as pool:
        return list(pool.map(lambda pair: grade(*pair), pairs))


def stats() -> dict[str, int]:
    """Counts since the process started: graded completions, decided by qerl / math-verify, timeouts."""
    with _stats_lock:
        return dict(_stats)


def start_worker(wait: bool = False) -> None:
    """Start math-verify's worker process now, in the background, instead of when an answer first needs it;
    `wait`: return once it is ready (or could not start)."""
    _mathverify.start(wait)


def grader_info() -> dict[str, str]:
    """What graded: recorded beside an accuracy so a number can be audited and reproduced."""
    from qerl import __version__

    version = _mathverify.version
    return {"grader": GRADER, "grader_version": f"{__version__}/rule-{RULE_VERSION}",
            "math_verify": version if version else f"unavailable ({_mathverify.unavailable})"}
