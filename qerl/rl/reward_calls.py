"""Calling a step's reward functions (`train.rewards`) on its completions, in either form, within a time budget.

qerl's form, `(completion, gold) -> float`, is called row by row; TRL's, `(prompts, completions, completion_ids,
**columns, trainer_state) -> list[float | None]`, once on the step's batch, as TRL's GRPOTrainer calls it. `async def`
functions (TRL's form) run together on one event loop (`asyncio.gather`, as TRL since PR #4567), alongside the sync
ones. A value of None leaves that row out of that function's term: the row's reward is the sum of the weighted values
it has (TRL's nansum), 0 where it has none (TRL's rule too, with a warning naming the row).

Each function has `train.reward_timeout_s` per step's batch. A sync function runs in a daemon thread of its own,
not a process: TRL runs reward functions in the trainer's process, and users' functions rely on it (clients, caches
and models they keep between calls, closures, inputs that do not pickle); a process per function would also pay a
Python start-up with the user's imports, and forking the trainer once CUDA and its threads run is unsafe. The price:
a thread cannot be killed. A function over its budget fails the step (the command then exits, which a daemon thread
does not hold up); in a process that lives on (a notebook, the in-process flow) it keeps running until it returns.
Code that must be cut off (running a model's program) belongs in a sandboxed process of its own, which the function
calls. A function whose own timeout uses signals (math-verify's `parse`/`verify` defaults: "signal only works in main
thread") needs the main thread: one that raises so is called again in the trainer's thread, and from then on there,
without a budget (a warning says so; one that swallows the error cannot be told). `reward_timeout_s: null` calls
every sync function there.

Whatever fails (raises, over its budget, a wrong length or type, NaN) is a `RewardFailed` naming the function, the
step and the row where one is known: one line from the command, exit 2, the run folder's checkpoints intact.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from qerl.data.rewards import RewardTerm
from qerl.errors import BadInput

log = logging.getLogger(__name__)

# TRL's arguments beside the data columns; columns of these names (and TRL's `prompt`, `completion`) are not passed.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
# TRL's with an environment_factory (rollout.environment): one environment per completion, as its tool calls left it
ENVIRONMENTS = "environments"
HIDDEN_COLUMNS = frozenset(TRL_ARGUMENTS) | {"prompt", "completion", ENVIRONMENTS}
# How long past the budget the caller waits for an async function's event loop to answer its cancellation
CANCEL_GRACE_S = 1.0


class RewardFailed(BadInput):
    """A reward function failed a step: it raised, ran past `train.reward_timeout_s`, or returned what is not one
    number (or None) per completion. The message names the function, the step and the row where known."""


@dataclass(frozen=True)
class TrainerState:
    """What TRL passes as `trainer_state` (transformers' TrainerState), as far as qerl knows it: `global_step`, the
    optimizer steps done before this one (0 in the first step, as TRL's), and `max_steps` (train.steps)."""

    global_step: int
    max_steps: int


@dataclass
class RewardInputs:
    """One step's rows as the reward functions see them, one entry per completion (`group_size` per prompt)."""

    prompts: list[Any]  # the rendered prompt text, or its chat messages (conversational)
    completions: list[Any]  # the text, or [{"role": "assistant", "content": text}] (conversational)
    texts: list[str]  # the completions' text (qerl's form)
    golds: list[str]  # the bare gold answers (qerl's form)
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]  # every data column, one value per completion
    trainer_state: TrainerState
    questions: list[str] = field(default_factory=list)  # for the error messages
    # rollout.environment: each completion's environment (what the factory made: TRL's object itself). None: none.
    environments: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def row(self, i: int) -> str:
        question = self.questions[i] if i < len(self.questions) else ""
        shown = question if len(question) <= 40 else question[:40] + "..."
        return f"row {i} (question {shown!r})" if question else f"row {i}"


@dataclass
class RewardScores:
    """The step's rewards: `total` per row (the weighted sum of the values it has) and each function's values by
    label (None: not applicable to that row)."""

    total: list[float]
    by_label: dict[str, list[float | None]]


class RewardCalls:
    """Calls the terms of a reward mix on a step's `RewardInputs` (`__call__`); `timeout_s` None: no budget."""

    def __init__(self, terms: list[RewardTerm], timeout_s: float | None):
        self.terms, self.timeout_s = list(terms), timeout_s
        self._loop: _EventLoop | None = None  # started by the first async function's call, kept across steps
        self._in_callers_thread: set[str] = set()  # sync functions found to need the main thread (signals)

    @property
    def needs_trl_inputs(self) -> bool:
        return any(t.form == "trl" for t in self.terms)

    def check_arguments(self, columns: list[str], environments: bool = False) -> None:
        """ValueError naming a TRL-form function whose required parameter neither TRL nor the data's `columns`
        provide (the run would fail at its first step, after the model loaded); `environments` only where the
        rollout has them (rollout.environment)."""
        given = set(TRL_ARGUMENTS) | (set(columns) - HIDDEN_COLUMNS) | {"gold"} | ({ENVIRONMENTS} if environments
                                                                                else set())
        for term in self.terms:
            if term.form != "trl":
                continue
            missing = [name for name in _Parameters.of(term.fn).required if name not in given]
            if missing:
                hint = " (environments come with rollout.environment)" if ENVIRONMENTS in missing else ""
                raise ValueError(f"reward {term.spec!r} needs {', '.join(map(repr, missing))}, which is neither one "
                                 f"of TRL's arguments ({', '.join(TRL_ARGUMENTS)}) nor a column of the data "
                                 f"({', '.join(sorted(set(columns) - HIDDEN_COLUMNS)) or 'none'}){hint}")

    def __call__(self, inputs: RewardInputs) -> RewardScores:
        step = inputs.trainer_state.global_step + 1
        pending = self._start_async([t for t in self.terms if t.is_async], inputs, step)
        values: dict[str, list[float | None]] = {}
        try:
            for term in self.terms:
                if not term.is_async:
                    values[term.label] = self._call_sync(term, inputs, step)
        except BaseException:
            if pending is not None:  # the step failed: its async rewards are cancelled, not left running
                pending[0].cancel()
            raise
        if pending is not None:
            values.update(self._wait_async(pending, inputs, step))
        by_label = {t.label: values[t.label] for t in self.terms}  # the mix's order
        total = []
        for i in range(len(inputs)):
            had = [(t.weight, by_label[t.label][i]) for t in self.terms if by_label[t.label][i] is not None]
            total.append(sum(w * v for w, v in had))  # in the mix's order, in float64: the legacy sum's rounding
        unscored = [i for i in range(len(inputs)) if all(by_label[t.label][i] is None for t in self.terms)]
        if unscored:
            log.warning("step %d: every reward function returned None for %d of %d completions (first: %s); they "
                        "are rewarded 0", step, len(unscored), len(inputs), inputs.row(unscored[0]))
        return RewardScores(total, by_label)

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()

    # ------------------------------------------------------------------------------------------------ sync

    def _call_sync(self, term: RewardTerm, inputs: RewardInputs, step: int) -> list[float | None]:
        progress = {"row": None}
        if term.form == "qerl":
            def call():
                out = []
                for i, (text, gold) in enumerate(zip(inputs.texts, inputs.golds)):
                    progress["row"] = i
                    out.append(term.fn(text, gold))
                return out
        else:
            kwargs = _trl_kwargs(term.fn, inputs)

            def call():
                return term.fn(**kwargs)
        here = self.timeout_s is None or term.label in self._in_callers_thread
        try:
            out = call() if here else _in_thread(call, self.timeout_s, f"reward {term.label}")
        except _OverBudget:
            where = f" on {inputs.row(progress['row'])}" if progress["row"] is not None else \
                f" on its batch of {len(inputs)} completions"
            raise RewardFailed(f"reward {term.spec!r} did not return within train.reward_timeout_s = "
                               f"{self.timeout_s:g} s at step {step}{where} (its thread cannot be stopped; "
                               "raise the budget, or give it a timeout of its own)") from None
        except Exception as e:  # noqa: BLE001 - the user's code: any error fails the step, naming it
            if not here and _needs_main_thread(e) and threading.current_thread() is threading.main_thread():
                # Its own timeout uses signals (math-verify's defaults): called again here, as TRL would, for good
                log.warning("reward %r needs the main thread (a signal-based timeout inside it): it is called in "
                            "the trainer's thread from now on, without train.reward_timeout_s", term.spec)
                self._in_callers_thread.add(term.label)
                return self._call_sync(term, inputs, step)
            row = progress["row"] if term.form == "qerl" else None
            raise _raised(term, e, step, inputs, row) from e
        if inspect.isawaitable(out):
            close = getattr(out, "close", None)
            if close is not None:  # never awaited: no "coroutine was never awaited" warning on top
                close()
            raise RewardFailed(f"reward {term.spec!r} returned an awaitable at step {step}: declare it async def")
        if term.form == "qerl":
            return [_number(term, v, i, step, inputs) for i, v in enumerate(out)]
        return _checked(term, out, step, inputs)

    # ------------------------------------------------------------------------------------------------ async

    def _start_async(self, terms: list[RewardTerm], inputs: RewardInputs, step: int):
        if not terms:
            return None
        if self._loop is None or self._loop.stuck:
            if self._loop is not None:  # a coroutine blocked its loop past the budget: that thread is lost
                self._loop.abandon()
            self._loop = _EventLoop()
        states = {t.label: "waiting" for t in terms}
        budget = self.timeout_s

        async def one(term: RewardTerm):
            states[term.label] = "running"
            start = time.monotonic()
            try:
                coro = term.fn(**_trl_kwargs(term.fn, inputs))
                out = await (coro if budget is None else asyncio.wait_for(coro, budget))
                return term, out, None
            except asyncio.TimeoutError as e:
                over = budget is not None and time.monotonic() - start >= budget
                return term, None, _OverBudget() if over else e
            except Exception as e:  # noqa: BLE001 - reported below, naming the function
                return term, None, e
            finally:
                states[term.label] = "done"

        async def gather():
            return await asyncio.gather(*(one(t) for t in terms))

        return self._loop.submit(gather()), terms, states, time.monotonic()

    def _wait_async(self, pending, inputs: RewardInputs, step: int) -> dict[str, list[float | None]]:
        future, terms, states, started = pending
        wait = None if self.timeout_s is None else max(0.0, started + self.timeout_s + CANCEL_GRACE_S
                                                        - time.monotonic())
        try:
            results = future.result(timeout=wait)
        except FutureTimeout:  # the loop itself did not answer: a coroutine blocks it (a sync call inside)
            future.cancel()
            self._loop.stuck = True
            blocking = [t.spec for t in terms if states[t.label] == "running"] or [t.spec for t in terms]
            raise RewardFailed(f"reward {blocking[0]!r} did not return within train.reward_timeout_s = "
                               f"{self.timeout_s:g} s at step {step} on its batch of {len(inputs)} completions, "
                               "and blocked its event loop (a blocking call in an async def: await it, or run it "
                               "with asyncio.to_thread)") from None
        out = {}
        for term, value, error in results:
            if isinstance(error, _OverBudget):
                raise RewardFailed(f"reward {term.spec!r} did not return within train.reward_timeout_s = "
                                   f"{self.timeout_s:g} s at step {step} on its batch of {len(inputs)} completions "
                                   "(cancelled)")
            if error is not None:
                raise _raised(term, error, step, inputs, None) from error
            out[term.label] = _checked(term, value, step, inputs)
        return out


# ---------------------------------------------------------------------------------------------------------------
# Arguments, results, errors
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parameters:
    """What a function's signature takes by keyword: each named parameter (required or not), and whether it takes
    every keyword (**kwargs, or a signature that cannot be read: it gets them all, as TRL would pass them)."""

    named: dict[str, bool]  # name -> required
    takes_all: bool

    @classmethod
    def of(cls, fn: Callable) -> "_Parameters":
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return cls({}, True)
        by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return cls({p.name: p.default is p.empty for p in params if p.kind in by_keyword},
                   any(p.kind is p.VAR_KEYWORD for p in params))

    @property
    def required(self) -> list[str]:
        """The ones it cannot be called without, **kwargs or not (`environments, **kwargs` needs environments)."""
        return [name for name, required in self.named.items() if required]


def _trl_kwargs(fn: Callable, inputs: RewardInputs) -> dict[str, Any]:
    """TRL's keyword arguments: prompts, completions, completion_ids, every data column (as TRL: all but prompt,
    completion and completion_ids), `gold` (qerl's bare answer, unless a column has that name), trainer_state and,
    with rollout.environment, `environments`; a function without **kwargs gets only the ones it names."""
    kwargs: dict[str, Any] = {"prompts": inputs.prompts, "completions": inputs.completions,
                              "completion_ids": inputs.completion_ids, "gold": inputs.golds}
    kwargs.update({k: v for k, v in inputs.columns.items() if k not in HIDDEN_COLUMNS})
    kwargs["trainer_state"] = inputs.trainer_state
    if inputs.environments is not None:
        kwargs[ENVIRONMENTS] = inputs.environments
    takes = _Parameters.of(fn)
    return kwargs if takes.takes_all else {k: v for k, v in kwargs.items() if k in takes.named}


def _checked(term: RewardTerm, out: Any, step: int, inputs: RewardInputs) -> list[float | None]:
    """A TRL-form result as one float (or None) per completion; RewardFailed naming what is wrong."""
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # a tensor or an array
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardFailed(f"reward {term.spec!r} returned {type(out).__name__} at step {step}: expected a list of "
                           f"{len(inputs)} numbers, one per completion (None where it does not apply)")
    if len(out) != len(inputs):
        raise RewardFailed(f"reward {term.spec!r} returned {len(out)} value{'' if len(out) == 1 else 's'} at step "
                           f"{step} for the step's "
                           f"{len(inputs)} completions: expected one per completion (None where it does not apply)")
    return [_number(term, v, i, step, inputs) for i, v in enumerate(out)]


def _number(term: RewardTerm, value: Any, i: int, step: int, inputs: RewardInputs) -> float | None:
    if value is None:
        return None
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):  # a 0-d tensor or a numpy scalar
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element
            pass
    if not isinstance(value, numbers.Real):
        raise RewardFailed(f"reward {term.spec!r} returned {_short(value)} ({type(value).__name__}) for "
                           f"{inputs.row(i)} at step {step}: expected a number, or None where it does not apply")
    value = float(value)
    if not math.isfinite(value):
        raise RewardFailed(f"reward {term.spec!r} returned {value} for {inputs.row(i)} at step {step}: expected a "
                           "finite number, or None where it does not apply")
    return value


def _raised(term: RewardTerm, e: BaseException, step: int, inputs: RewardInputs, row: int | None) -> RewardFailed:
    """The one line for a reward function's exception: where in the user's code, and on which row if known."""
    frames = traceback.extract_tb(e.__traceback__)
    try:  # the deepest line in the function's own file, else the deepest of all (a library's)
        own = inspect.getsourcefile(term.fn)
    except TypeError:
        own = None
    frames = [f for f in frames if f.filename == own] or frames
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    on = inputs.row(row) if row is not None else f"its batch of {len(inputs)} completions"
    text = " ".join(str(e).split())
    hint = ""
    if _needs_main_thread(e):  # and the trainer runs outside it (e.g. a task runner's thread)
        hint = " (it needs the main thread, as signal-based timeouts do; the trainer runs in another thread here)"
    return RewardFailed(f"reward {term.spec!r} raised on {on} at step {step}: {type(e).__name__}"
                        f"{': ' + text if text else ''}{where}{hint}")


def _needs_main_thread(e: BaseException | None) -> bool:
    """Python's refusal of `signal.signal` outside the main thread, however wrapped (math-verify re-raises it as
    a ValueError of its own, from the original)."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, ValueError) and "signal only works in main thread" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------------------------


class _OverBudget(Exception):
    """A call ran past its budget (raised in the caller; the call itself may run on)."""


def _in_thread(call: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """`call()` in a daemon thread, its result or its exception; `_OverBudget` after `timeout_s`. A daemon thread,
    not a ThreadPoolExecutor's: the interpreter joins those at exit, so a hung reward would hold the command open."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(timeout_s):
        raise _OverBudget()
    if "error" in box:
        raise box["error"]
    return box["value"]


class _EventLoop:
    """An asyncio loop in a daemon thread of its own, kept across steps (as TRL's): clients an async reward opens
    on its first call (an HTTP session) belong to one loop, which must outlive the step."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stuck = False
        self.thread = threading.Thread(target=self.loop.run_forever, name="qerl async rewards", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.stuck:
            return self.abandon()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()

    def abandon(self) -> None:
        """Leave a blocked loop to its thread (it cannot be stopped from outside); ask it to stop when it can."""
        self.loop.call_soon_threadsafe(self.loop.stop)
