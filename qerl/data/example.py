"""One problem, the plain record that the loaders, the tables, the RL loop, the evaluator and the pipeline share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Example:
    """One problem. `gold` is the bare final answer (e.g. "42", "\\frac{14}{3}"), `source` names its grader family.

    `columns` is the data row it came from, every column by name (a generated arithmetic problem: `question` and
    `answer`): what TRL-form reward functions get as keyword arguments (qerl.rl.reward_calls). Not part of an
    example's identity (equality, hash) nor of its repr, which would print whole solutions."""

    id: str
    question: str
    gold: str
    source: str
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
