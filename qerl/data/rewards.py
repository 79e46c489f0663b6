"""Reward functions for RL on math reasoning: the accuracy reward (the grader), a format reward, and the registry.

Grading itself lives in qerl.grading (extraction, qerl's own bounded equality, math-verify in a worker process);
`score` is its reward face: 1.0 or 0.0, never raises, returns within about a second on any input.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Callable

from qerl import grading
from qerl.grading.equality import answers_equal
from qerl.grading.extract import matching_brace, extract_answer
from qerl.grading.normalize import normalize_answer

__all__ = ["RewardFn", "REWARDS", "score", "format_reward", "get_reward_fn", "combined_reward", "extract_answer",
           "normalize_answer", "answers_equal"]

RewardFn = Callable[[str, str], float]


def score(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold answer, else 0.0 (qerl.grading.grade). Never raises.

    `gold` may be a bare answer ("72", "\\frac{14}{3}", "x<1"), a GSM8K solution ending `#### 72`, or a MATH
    solution with `\\boxed{}`.
    """
    return grading.grade(completion, gold).score


MIN_REASONING_CHARS = 20
_AFTER_BOX_RE = re.compile(r"[\s$.!)\]\\]*")  # closing `$`, `\]`, `\)`, a full stop


def format_reward(completion: str, gold: str = "") -> float:
    """1.0 if the completion reasons, then gives exactly one final boxed answer, else 0.0.

    Rule: exactly one `\\boxed{...}` / `\\fbox{...}`, closed and non-empty; at least
    MIN_REASONING_CHARS non-space characters before it; after it only whitespace, `$`, `\\]`, `\\)`
    and end punctuation. `gold` is ignored (same signature as every reward).
    """
    try:
        if completion.count("\\boxed") + completion.count("\\fbox") != 1:
            return 0.0
        start = max(completion.find("\\boxed"), completion.find("\\fbox"))
        open_at = completion.find("{", start)
        if open_at < 0 or completion[start:open_at] not in ("\\boxed", "\\fbox"):
            return 0.0
        close_at = matching_brace(completion, open_at)
        if close_at is None or not completion[open_at + 1 : close_at].strip():
            return 0.0
        reasoning = re.sub(r"\s", "", completion[:start])
        if len(reasoning) < MIN_REASONING_CHARS:
            return 0.0
        return 1.0 if _AFTER_BOX_RE.fullmatch(completion[close_at + 1 :]) else 0.0
    except Exception:
        return 0.0


REWARDS: dict[str, RewardFn] = {"accuracy": score, "format": format_reward}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name (see REWARDS) or a user function given as "package.module:function"."""
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown reward {name!r}: use one of {sorted(REWARDS)} or 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {module_name}.{attr} is not callable")
    return fn


def combined_reward(specs: dict[str, float]) -> RewardFn:
    """Weighted sum of named rewards, e.g. {"accuracy": 1.0, "format": 0.1}; names resolve up front."""
    if not specs:
        raise ValueError("combined_reward needs at least one reward spec")
    terms = [(get_reward_fn(name), float(weight)) for name, weight in specs.items()]
    if not all(math.isfinite(weight) for _, weight in terms):
        raise ValueError(f"reward weights must be finite numbers: {specs}")

    def reward(completion: str, gold: str) -> float:
        return sum(weight * fn(completion, gold) for fn, weight in terms)

    reward.__doc__ = f"Weighted reward {dict(specs)}."
    return reward
