"""Can the trainer continue from a checkpoint's state? Its structure checked before any of it is applied.

A checkpoint whose files match its manifest can still be inconsistent: edited by hand or by a tool that wrote the
manifest again, or written for other shapes. Applied as it was, such a state failed half-way (`"step": "three"`, an
optimizer state that is a number: a traceback after the adapter was loaded) or, worse, later: a moment tensor of
another shape loads without complaint and fails at the first optimizer step. `first_problem` says what does not fit
in a few words, and the trainer has the run folder set such a checkpoint aside as it does one with damaged bytes.

What is checked is what `Trainer.apply_checkpoint` hands to PyTorch, numpy and Python, which check little: the
optimizer against the live one's parameters (every tensor's shape, 0-dim ones included, against what the live
optimizer keeps per parameter), the scheduler, the data sampler, the RNG states, the AQN schedule, the speculative
rollouts' draft history. Values are their owners' business, asked before anything is applied: the sampler and the
draft history load the state into a throwaway copy (a position within range), a learning rate is the run's. What is
checked of values is what the update cannot compute with: moments that are not finite (or negative second moments),
a step count that is none, a hyperparameter that is no number, and a schedule that counted more updates than steps.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from qerl.data.problems import PromptSampler


class Live(NamedTuple):
    """The trainer's parts a state is applied to."""

    optimizer: torch.optim.Optimizer
    sampler: PromptSampler


def first_problem(state: dict[str, Any], optimizer: torch.optim.Optimizer, sampler: PromptSampler) -> str | None:
    """What first keeps `state` (a trainer state, its `step` already checked) from being applied to a trainer with
    `optimizer` and `sampler`, in a few words starting with the key (`optimizer.state[0].exp_avg has shape ...`);
    None if it fits. Changes neither."""
    live = Live(optimizer, sampler)
    for check in (_optimizer, _scheduler, _sampler, _rng, _aqn, _drafts):
        problem = check(state, live)
        if problem:
            return problem
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list, tuple, Tensor, np.ndarray)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _kept_per_parameter(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, bool]:
    """What `optimizer`'s kind keeps per parameter under `group`'s settings: name -> whether it has the parameter's
    shape (else it is a scalar: AdamW's exp_avg and exp_avg_sq have the shape, its step is a 0-dim count). Learnt
    from one step of a twin on a throwaway parameter, so it is torch's answer for this optimizer and its options
    (amsgrad adds max_exp_avg_sq), not a copy of it here."""
    like = group["params"][0] if group["params"] else torch.zeros(())
    probe = torch.zeros(2, 3, dtype=like.dtype, device=like.device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    twin = type(optimizer)([{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
    twin.step()
    return {name: isinstance(value, Tensor) and value.shape == probe.shape
            for name, value in twin.state[probe].items()}


def _optimizer(state: dict[str, Any], live: Live) -> str | None:
    optimizer = live.optimizer
    saved = state["optimizer"]
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        return f"optimizer = {_shown(saved)}: not an optimizer state (state and param_groups)"
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups):
        return f"optimizer has {len(saved['param_groups'])} parameter groups, this run {len(groups)}"
    shapes: dict[int, torch.Size] = {}
    kept: dict[int, dict[str, bool]] = {}  # parameter index -> what the live optimizer keeps for it
    for i, (group, ours) in enumerate(zip(saved["param_groups"], groups)):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or not all(map(_is_int, params)) or len(params) != len(ours["params"]):
            return (f"optimizer.param_groups[{i}] holds {len(params) if isinstance(params, list) else 'no'} "
                    f"parameters, this run {len(ours['params'])} (another adapter shape)")
        problem = _hyperparameters(group, ours, type(optimizer).__name__)
        if problem:
            return f"optimizer.param_groups[{i}].{problem}"
        shapes.update({index: p.shape for index, p in zip(params, ours["params"])})
        per_parameter = _kept_per_parameter(optimizer, ours)
        kept.update(dict.fromkeys(params, per_parameter))
    kind = type(optimizer).__name__
    for index, moments in saved["state"].items():
        if index not in shapes or not isinstance(moments, dict):
            return f"optimizer.state[{index!r}] = {_shown(moments)}: no parameter of this run"
        if not moments:  # no step taken for it yet: the optimizer starts its state afresh
            continue
        missing = [name for name in kept[index] if name not in moments]
        if missing:
            return f"optimizer.state[{index}] lacks {', '.join(missing)}, which {kind} keeps per parameter"
        for name, like_parameter in kept[index].items():
            value = moments[name]
            expected = shapes[index] if like_parameter else torch.Size()
            if not isinstance(value, Tensor):
                return f"optimizer.state[{index}].{name} = {_shown(value)}: not a tensor"
            if value.shape != expected:
                return (f"optimizer.state[{index}].{name} has shape {tuple(value.shape)}, "
                        + (f"its parameter {tuple(expected)}" if like_parameter else f"a scalar in {kind}"))
            problem = _moment_value(name, value)
            if problem:
                return f"optimizer.state[{index}].{name} {problem}"
    return None


def _hyperparameters(saved: dict[str, Any], ours: dict[str, Any], kind: str) -> str | None:
    """What of a saved parameter group's numbers (lr, betas, eps, weight_decay) the optimizer cannot compute with,
    starting with the key, or None. `load_state_dict` puts them in place of the live group's unchecked (a string
    learning rate failed in the first update with a TypeError); their values are the run's, only their kind is
    checked here. Keys the live group lacks or the saved one does not hold are torch's to add or drop."""
    for key, like in ours.items():
        if key == "params" or key not in saved:
            continue
        value = saved[key]
        if _is_number(like) and not (_is_number(value) and math.isfinite(value)):
            return f"{key} = {_shown(value)}: not a number, as in {kind}"
        if isinstance(like, tuple) and all(map(_is_number, like)) and not (
                isinstance(value, (tuple, list)) and len(value) == len(like)
                and all(_is_number(v) and math.isfinite(v) for v in value)):
            return f"{key} = {_shown(value)}: not a {'pair' if len(like) == 2 else 'tuple'} of numbers, as in {kind}"
    return None


# AdamW's second moments: the update divides by their square roots, so a negative one is NaN in the first step.
_NONNEGATIVE_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")


def _moment_value(name: str, value: Tensor) -> str | None:
    """What keeps a per-parameter tensor of the right shape from being used ("holds ..."), or None. A NaN moment
    loaded without a word and made every trained weight NaN; a negative step count failed in the first update (the
    bias correction's root of a negative number: "ComplexFloat can't be cast"). One pass over the moments on their
    device, as the optimizer's own step makes."""
    if name == "step":  # torch's per-parameter count of updates, in every optimizer that keeps one
        count = float("nan") if value.is_complex() else float(value)
        if not (math.isfinite(count) and count >= 0 and count == int(count)):
            return f"= {_shown(count)}: not a count of steps"
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        return "holds values that are not finite (NaN or infinity)"
    if name in _NONNEGATIVE_MOMENTS and bool((value < 0).any()):
        return "holds negative values (a second moment is a mean of squares)"
    return None


def _scheduler(state: dict[str, Any], live: Live) -> str | None:
    saved = state["scheduler"]
    if not isinstance(saved, dict):
        return f"scheduler = {_shown(saved)}: not a learning-rate scheduler state"
    if not _is_int(saved.get("last_epoch")):
        return f"scheduler.last_epoch = {_shown(saved.get('last_epoch'))}: not a step count"
    updates = saved["last_epoch"]  # the updates that ran (a step without informative groups runs none): <= step
    if updates < 0:
        return f"scheduler.last_epoch = {updates}: not a count of updates"
    if updates > state["step"]:  # the learning rate of another point of the run
        return f"scheduler.last_epoch = {_shown(updates)}: updates counted past the checkpoint's step {state['step']}"
    base = saved.get("base_lrs")
    if not isinstance(base, list) or len(base) != len(live.optimizer.param_groups) \
            or not all(map(_is_number, base)):
        return f"scheduler.base_lrs = {_shown(base)}: not one learning rate per parameter group"
    return None


def _sampler(state: dict[str, Any], live: Live) -> str | None:
    saved = state["sampler"]
    keys = ("seed", "epoch", "position", "num_examples")  # qerl.data.problems.PromptSampler.state_dict
    if not isinstance(saved, dict) or not all(_is_int(saved.get(k)) for k in keys):
        return f"sampler = {_shown(saved)}: not a data position ({', '.join(keys)}: integers)"
    try:  # its own checks (the example count, a position within the epoch), on a copy: the live one is untouched
        copy.copy(live.sampler).load_state_dict(saved)
    except (ValueError, TypeError, KeyError) as e:
        return f"sampler: {' '.join(str(e).split())[:120]}"
    return None


def _rng(state: dict[str, Any], live: Live) -> str | None:
    saved = state["rng"]
    if not isinstance(saved, dict):
        return f"rng = {_shown(saved)}: not the random generators' states"
    python = saved.get("python")
    if not (isinstance(python, tuple) and len(python) == 3 and isinstance(python[1], tuple)
            and all(map(_is_int, python[1]))):
        return "rng.python: not a state of Python's random module"
    numpy = saved.get("numpy")
    if not (isinstance(numpy, tuple) and len(numpy) == 5 and isinstance(numpy[1], np.ndarray)
            and numpy[1].shape == np.random.get_state()[1].shape):
        return "rng.numpy: not a state of numpy's global generator"
    if not _is_byte_state(saved.get("torch"), torch.get_rng_state()):
        return "rng.torch: not a state of torch's CPU generator"
    cuda = saved.get("cuda")  # None: saved without CUDA (a CPU run)
    if cuda is not None and not (isinstance(cuda, list) and all(_is_byte_state(t) for t in cuda)):
        return "rng.cuda: not the states of CUDA generators"
    return None


def _is_byte_state(value: Any, like: Tensor | None = None) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.uint8 and value.dim() == 1 \
        and (like is None or value.shape == like.shape)


def _aqn(state: dict[str, Any], live: Live) -> str | None:
    saved = state.get("aqn", {})  # older checkpoints: none (a geometric schedule, which keeps no state)
    if not isinstance(saved, dict) or not all(map(_is_number, saved.values())):
        return f"aqn = {_shown(saved)}: not an AQN schedule's state"
    for key, value in saved.items():  # the entropy schedule's sigma scales the noise: NaN would make every weight NaN
        if not math.isfinite(value):
            return f"aqn.{key} = {value}: not a finite number"
    return None


def _drafts(state: dict[str, Any], live: Live) -> str | None:
    saved = state.get("drafts")  # older checkpoints: none (speculation then drafts from the step's own rows)
    if saved is None:
        return None
    from qerl.rollout.drafts import DraftHistory

    try:  # loaded into a throwaway history: its own checks (offsets, counts, format) are the structure's
        DraftHistory().load_state_dict(saved)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, AttributeError) as e:
        return f"drafts = {_shown(saved)}: not a draft history ({' '.join(str(e).split())[:80]})"
    return None
