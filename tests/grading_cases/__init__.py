"""Grading case tables (issue #29): math-verify's own test suite and completion-style cases, with their sources."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tests.grading_cases.completions import CASES as _COMPLETION_CASES

HERE = Path(__file__).resolve().parent

# math-verify suite cases whose expectation holds only under a non-default math-verify option (the suite also has
# the same pair under the default with the opposite expectation): a grader with fixed rules cannot match both.
OPTION_DEPENDENT = {"strict": False, "allow_set_relation_comp": True}


@dataclass(frozen=True)
class Case:
    source: str  # where the case comes from (file::test, or completions.py and its note)
    completion: str
    gold: str
    expected: int  # 1 right, 0 wrong: what a careful grader says

    @property
    def key(self) -> str:
        return f"{self.source} | {self.gold!r} | {self.completion[:60]!r}"


def math_verify_suite(judged_only: bool = True) -> list[Case]:
    """The parametrized cases of math-verify's tests (see math_verify_suite.json for the commit); `judged_only`
    drops those whose expectation depends on a non-default option (OPTION_DEPENDENT) or a precision other than
    math-verify's default."""
    table = json.loads((HERE / "math_verify_suite.json").read_text())
    out = []
    for c in table["cases"]:
        options = c["options"]
        if judged_only and (any(options.get(k) == v for k, v in OPTION_DEPENDENT.items())
                            or options.get("precision", 6) < 5):
            continue
        out.append(Case(c["source"], c["prediction"], c["gold"], c["expected"]))
    return out


def completion_cases() -> list[Case]:
    return [Case(f"completions.py: {note}", completion, gold, expected)
            for completion, gold, expected, note in _COMPLETION_CASES]
