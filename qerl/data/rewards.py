"""Reward functions for RL on math reasoning: the accuracy reward (the grader), a format reward, and the registry.

Grading itself lives in qerl.grading (extraction, qerl's own bounded equality, math-verify in a worker process);
`score` is its reward face: 1.0 or 0.0, never raises, returns within about a second on any input.

A reward function takes one of two forms (`reward_form`): qerl's, `(completion, gold) -> float`, called row by row,
or TRL's, `(prompts, completions, completion_ids, **columns) -> list[float | None]`, called once per step's batch,
sync or `async def`. `reward_terms` resolves `train.rewards` into both; qerl.rl.reward_calls calls them.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

from qerl import grading
from qerl.grading.equality import answers_equal
from qerl.grading.extract import matching_brace, extract_answer
from qerl.grading.normalize import normalize_answer
from qerl.plugins import resolve_callable, split_spec

__all__ = ["RewardFn", "REWARDS", "score", "format_reward", "get_reward_fn", "combined_reward", "extract_answer",
           "normalize_answer", "answers_equal", "RewardForm", "RewardTerm", "reward_form", "reward_terms"]

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
    """A built-in reward by name (see REWARDS) or a user function given as "package.module:function" (or
    "path/to/file.py:function"; `qerl.plugins` resolves it, as it does tools)."""
    if name in REWARDS:
        return REWARDS[name]
    if split_spec(name) is None:
        raise ValueError(f"unknown reward {name!r}: use one of {sorted(REWARDS)} or 'package.module:function'")
    return resolve_callable(name, "reward")


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


# ---------------------------------------------------------------------------------------------------------------
# The two forms: qerl's (one row) and TRL's (one batch)
# ---------------------------------------------------------------------------------------------------------------

RewardForm = Literal["qerl", "trl"]
FORMS: tuple[RewardForm, ...] = ("qerl", "trl")


def is_async(fn: Callable) -> bool:
    """An `async def` function (or a callable object whose `__call__` is one, or a partial of either)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def reward_form(fn: Callable, name: str) -> RewardForm:
    """The form `fn`'s signature says: TRL's where a parameter is named `completions` or it takes `**kwargs` (every
    TRL reward does one or the other: TRL passes everything by keyword); qerl's where it can be called with two
    positional arguments `(completion, gold)`. Anything else is a ValueError asking for `train.reward_forms`."""
    declare = f"declare its form in train.reward_forms ({name}: trl or qerl)"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none
        raise ValueError(f"reward {name!r}: its signature cannot be read; {declare}") from None
    params = signature.parameters.values()
    if "completions" in signature.parameters or any(p.kind is p.VAR_KEYWORD for p in params):
        return "trl"
    try:
        signature.bind(None, None)
        return "qerl"
    except TypeError:
        raise ValueError(f"reward {name!r}: its signature {signature} is neither TRL's (a `completions` parameter "
                         f"or **kwargs) nor qerl's (completion, gold); {declare}") from None


@dataclass(frozen=True)
class RewardTerm:
    """One function of the run's reward mix: `spec` as `train.rewards` names it, its weight and form, and `label`,
    its name in the metrics (`rewards/<label>/mean`): the function's own name, as TRL logs it."""

    spec: str
    fn: Callable[..., Any]
    weight: float
    form: RewardForm
    label: str

    @property
    def is_async(self) -> bool:
        return is_async(self.fn)


def reward_terms(specs: dict[str, float], forms: dict[str, str] | None = None) -> list[RewardTerm]:
    """The reward mix `specs` (name or module:function -> weight), each function's form declared in `forms` or read
    from its signature (`reward_form`). ValueError for an unknown name, a form that cannot be told, an `async def` in
    qerl's form, or a declared form for a function the mix does not hold."""
    forms = dict(forms or {})
    if not specs:
        raise ValueError("the reward mix needs at least one reward function (e.g. accuracy: 1.0)")
    unknown = sorted(set(forms) - set(specs))
    if unknown:
        raise ValueError(f"reward_forms names {', '.join(map(repr, unknown))}, which rewards does not hold")
    terms = []
    for spec, weight in specs.items():
        if not math.isfinite(float(weight)):
            raise ValueError(f"reward {spec!r}: weight {weight!r} is not a finite number")
        fn = get_reward_fn(spec)
        form = forms.get(spec) or reward_form(fn, spec)
        if form not in FORMS:
            raise ValueError(f"reward_forms.{spec} = {form!r}: use trl or qerl")
        if form == "qerl" and is_async(fn):
            raise ValueError(f"reward {spec!r}: an async def reward takes TRL's form "
                             "(prompts, completions, completion_ids, **kwargs) -> list[float | None]")
        terms.append(RewardTerm(spec, fn, float(weight), form, _label(spec)))
    labels = [t.label for t in terms]
    # Two functions of one name (from two modules): the full spec, as a metric name can write it
    return [t if labels.count(t.label) == 1 else RewardTerm(t.spec, t.fn, t.weight, t.form, t.spec.replace(":", "."))
            for t in terms]


def _label(spec: str) -> str:
    """A built-in's name, or the function's name of "package.module:function" (`rewards/<label>/mean`; MLflow's
    metric names take no colon)."""
    return spec.rpartition(":")[2].rpartition(".")[2] if ":" in spec else spec
