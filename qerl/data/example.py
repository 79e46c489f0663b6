"""One problem, the plain record that the loaders, the tables, the RL loop, the evaluator and the pipeline share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One problem. `gold` is the bare final answer (e.g. "42", "\\frac{14}{3}"), `source` names its grader family."""

    id: str
    question: str
    gold: str
    source: str
