"""Multi-turn rollouts: rows that call tools while the others keep decoding.

`generate_with_tools` drives one engine call (`RolloutEngine.open` with a `ToolStop`): a row whose turn ends with a
tool call (`qerl.rollout.tool_calls`, the closing tag found in its decoded turn) waits, keeping its KV cache row; its
call runs on a thread of `ToolRunner` (several rows' calls at once), and the engine's next steps decode every other
row meanwhile. When the answer is back, the tool turn (the chat template's glue around it, `ToolTurn`) is appended to
the row: only those tokens are prefilled into its cache row, after its own (`RolloutEngine.extend_row`: no prefix is
recomputed), and it decodes on. The loop waits for a tool only when no row can decode.

Per row: at most `max_turns` tool calls (TRL's `max_tool_calling_iterations`; the completion ends at the one past
it, stop reason stop); its generated and appended tokens together within `max_new_tokens` (an answer that does not
fit ends it there, stop reason length); a call that takes longer than `timeout_s` is answered with an error string
and the rollout goes on (the call's thread is left to finish; it is a daemon, so it never holds the process: a tool
that must be stopped runs in a process of its own, as qerl's sandboxed interpreter does).

The tokens a tool appended have log-prob 0 and `generated_mask` False in the `Rollout`: the trainer trains on the
model's own tokens only. A call is parsed here (`tool_calls`) and run by `qerl.tools.call_tool` (every failure an
"Error: ..." text for the model), or with `ToolUse.environment` by the row's own `qerl.tools.Environment` (reset
with its data row before the rollout; its `reward` is not read here: scoring is the reward functions', which get
the rows' environments through `Rollout.environments`).
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qerl.plugins import resolve_callable
from qerl.rollout.rows import RowState
from qerl.rollout.sampling import Rollout
from qerl.tools.environment import environment_factory, episode_rewards
from qerl.tools.schema import tool_name, tool_schemas
from qerl.rollout.tool_calls import HERMES, ToolCallFormat, ToolTurn, call_tool, load_tools, parse_call

__all__ = ["ToolUse", "ToolRunner", "generate_with_tools", "tool_use_of"]


@dataclass(frozen=True)
class ToolUse:
    """The tools of a rollout and their limits. `turn`: the glue around a tool's answer (None: from the tokenizer's
    chat template, `ToolTurn.from_template`)."""

    tools: dict[str, Callable[..., Any]]
    max_turns: int | None = None  # tool calls per row (None: as many as its token budget allows)
    timeout_s: float = 30.0  # a call's wall time, from when its thread starts
    workers: int = 8  # calls running at once
    format: ToolCallFormat = HERMES
    turn: ToolTurn | None = None
    # One `qerl.tools.Environment` per row (a zero-argument factory, as TRL's environment_factory): reset with its
    # data row before the rollout, its `step(name, arguments)` answers the row's calls. None: `tools`, stateless.
    environment: Callable[[], Any] | None = None

    def environment_reward(self) -> tuple[str, Callable[..., list]] | None:
        """(its class's name, its TRL-form reward function) for an environment that scores (`get_reward`, or a
        `qerl.tools.Environment`'s own `reward`): TRL adds it to the reward functions, weight 1, under that name.
        None without one."""
        if self.environment is None:
            return None
        probe = self.environment()
        fn = episode_rewards(probe)
        return None if fn is None else (type(probe.instance).__name__, fn)


def tool_use_of(rollout: Any) -> ToolUse | None:
    """The tools and limits of a `rollout:` section (its tools, environment, max_tool_calling_iterations,
    tool_timeout_s, tool_workers); None without tools or an environment. ValueError naming rollout.tools or
    rollout.environment when one does not resolve (or its factory fails, or a tool has no schema)."""
    if not rollout.tools and rollout.environment is None:
        return None
    try:
        tools = load_tools(rollout.tools)
        tool_schemas(list(tools.values()))  # a tool without hints or an Args: docstring fails now, in one line
    except ValueError as e:
        raise ValueError(f"rollout.tools = {rollout.tools}: {e}") from None
    environment = None
    if rollout.environment is not None:
        try:
            environment = environment_factory(resolve_callable(rollout.environment, "environment"),
                                              tools=list(tools.values()))
            # What the prompts announce: one instance's tools (bound methods; every row's have the same schemas)
            tools = {tool_name(t): t for t in environment().tools}
        except ValueError as e:  # qerl.tools' ToolError included
            raise ValueError(f"rollout.environment = {rollout.environment!r}: {e}") from None
    return ToolUse(tools, max_turns=rollout.max_tool_calling_iterations, timeout_s=rollout.tool_timeout_s,
                   workers=rollout.tool_workers, environment=environment)


@dataclass
class _Running:
    index: int  # the call's row
    started: float


@dataclass
class ToolRunner:
    """The tool calls of one rollout, each on a daemon thread (at most `workers` at once), off the decode loop:
    `submit` a row's call, `ready` the answers back (and the calls past their time, answered with an error)."""

    use: ToolUse
    stats: dict[str, float] = field(default_factory=lambda: {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0,
                                                             "tool_turn_prefills": 0,
                                                             "tool_seconds": 0.0, "idle_seconds": 0.0})

    envs: list[Any] | None = None  # the rows' environments (`ToolUse.environment`), by row

    def __post_init__(self):
        self._done: queue.Queue = queue.Queue()
        self._queued: deque[tuple[int, int, str]] = deque()
        self._running: dict[int, _Running] = {}  # call id -> its row and start
        self._ids = itertools.count()

    @property
    def pending(self) -> int:
        return len(self._queued) + len(self._running)

    def submit(self, index: int, text: str) -> None:
        """Run the tool call that ends row `index`'s turn `text`."""
        self._queued.append((next(self._ids), index, text))
        self.stats["tool_calls"] += 1
        self._start()

    def _start(self) -> None:
        while self._queued and len(self._running) < self.use.workers:
            call_id, index, text = self._queued.popleft()
            self._running[call_id] = _Running(index, time.monotonic())
            threading.Thread(target=self._run, args=(call_id, index, text), daemon=True,
                             name=f"qerl-tool-{index}").start()

    def _run(self, call_id: int, index: int, text: str) -> None:
        start = time.monotonic()
        if self.envs is None:
            answer = call_tool(self.use.tools, self.use.format, text)
        else:  # the row's own environment (one call of a row at a time: it waits for its answer)
            call = parse_call(self.use.format, text)
            answer = call if isinstance(call, str) else _text(self.envs[index].step(*call))
        self._done.put((call_id, answer, time.monotonic() - start))

    def ready(self, block: bool = False) -> list[tuple[int, str]]:
        """(row, answer) of the calls finished (or past their time) now, by row; with `block`, first wait for one
        (or for the next call's time to run out)."""
        answers: dict[int, str] = {}
        if block and self._running:
            waited = time.monotonic()
            deadline = min(r.started for r in self._running.values()) + self.use.timeout_s
            self._take(timeout=max(1e-3, deadline - waited), into=answers)
            self.stats["idle_seconds"] += time.monotonic() - waited
        self._take(timeout=None, into=answers)
        now = time.monotonic()
        for call_id, run in list(self._running.items()):
            if now - run.started > self.use.timeout_s:  # its thread finishes on its own; its answer is dropped
                del self._running[call_id]
                answers[run.index] = f"Error: the tool call took longer than {self.use.timeout_s:g} s"
                self.stats["tool_timeouts"] += 1
                self.stats["tool_errors"] += 1
        self._start()
        return sorted(answers.items())

    def _take(self, timeout: float | None, into: dict[int, str]) -> None:
        """Answers off the queue: one within `timeout` seconds then all there are, or (None) all there are now."""
        while True:
            try:
                call_id, answer, seconds = self._done.get(timeout=timeout) if timeout else self._done.get_nowait()
            except queue.Empty:
                return
            timeout = None
            run = self._running.pop(call_id, None)
            if run is None:  # answered already: it ran out of time
                continue
            into[run.index] = answer
            self.stats["tool_seconds"] += seconds
            self.stats["tool_errors"] += answer.startswith("Error: ")


def generate_with_tools(engine: Any, tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]],
                        max_new_tokens: int, use: ToolUse, rows: Sequence[Mapping[str, Any]] | None = None,
                        **sampling) -> tuple[Rollout, dict[str, float]]:
    """`RolloutEngine.generate`'s rollout of `prompts` (the keyword arguments of `open` in `sampling`), its rows
    calling `use.tools` (or each its `use.environment`, reset with `rows[i]`, its data row's columns); returns it
    (with `generated_mask`, and `environments`, the rows' own, with an environment) and the calls' counts:
    tool_calls, tool_errors, tool_timeouts, tool_seconds (the calls' wall time, summed), idle_seconds (time no
    row could decode: every unfinished row waited for a tool) and tool_turn_prefills (the forwards that prefilled
    the tool turns: on the bucketed engine, turns answered close together share one, `_HeldTurns`)."""
    if tokenizer is None:
        raise ValueError("multi-turn rollouts need a tokenizer: tool calls are found in the decoded text")
    turn = use.turn or ToolTurn.from_template(tokenizer)
    stop = use.format.stop(tokenizer)
    runner = ToolRunner(use, envs=_environments(use, len(prompts), rows))
    held = _HeldTurns(batch=not getattr(engine, "exact", True))
    with engine.open(tokenizer, prompts, max_new_tokens, tools=stop, **sampling) as call:
        while not call.stopped:
            moved = call.advance()
            for row in call.tool_calls():
                if use.max_turns is not None and row.turns >= use.max_turns:
                    call.end_turns(row.index)
                else:
                    runner.submit(row.index, stop.decode(row.tool_call))
            answered = runner.ready(block=not moved and not call.stopped and not _decoding(call))
            for index, answer in answered:
                _append(call, held, index, turn.tokens(tokenizer, answer))
            held.release(call, runner.stats)
        out = call.result()
    if runner.envs is not None:  # for the reward functions (TRL's `environments`): each row's state at its end
        out.environments = runner.envs
    return out, runner.stats


def _environments(use: ToolUse, n: int, rows: Sequence[Mapping[str, Any]] | None) -> list[Any] | None:
    """One environment per row, reset with its data row, before anything is sampled. An environment whose reset
    returns text (TRL adds it to the first user turn) is refused: the prompts are rendered before the rollout here."""
    if use.environment is None:
        return None
    envs = [use.environment() for _ in range(n)]
    for i, env in enumerate(envs):
        text = env.reset(dict(rows[i]) if rows is not None else {})
        if text:
            raise ValueError(f"environment {type(env).__name__}: its reset returned text for the first user turn, "
                             "which multi-turn rollouts do not add to the prompt yet; return None from reset")
    return envs


def _text(answer: Any) -> str:
    return "" if answer is None else answer if isinstance(answer, str) else str(answer)


def _decoding(call: Any) -> bool:
    return any(r.state is RowState.DECODING for r in call.rows)


def _append(call: Any, held: "_HeldTurns", index: int, tokens: list[int]) -> None:
    """The tool turn `tokens` after row `index`'s call (held to be prefilled), or its end there when its budget has
    no room for them and one token more."""
    row = call.rows[index]
    if tokens and row.count + len(tokens) < row.budget:
        held.add(index, tokens)
    else:
        call.end_turns(index, truncated=True)


class _HeldTurns:
    """Tool turns answered but not prefilled yet. A prefill is one eager forward whose cost is its host launches,
    whatever its rows (BENCHMARKS.md, "The owed GPU chain": ~90 ms on a 7B for 1 or 64 rows, against ~7 ms per
    decode step), and it stalls every decoding row: turns answered close together are prefilled together. One is
    held while rows decode, until as many are held as a quarter of the decoding rows, or the first has waited as
    long as the last prefill took (so a held row never loses more than one prefill's time), or none decodes. The
    exact engine prefills each row alone (its rounding must not depend on the tools' timing): nothing is held."""

    def __init__(self, batch: bool):
        self.batch, self.turns, self.since, self.prefill_s = batch, [], 0.0, 0.0

    def add(self, index: int, tokens: list[int]) -> None:
        if not self.turns:
            self.since = time.monotonic()
        self.turns.append((index, tokens))

    def release(self, call: Any, stats: dict[str, float]) -> None:
        """Prefill the held turns now, unless holding them longer pays (above)."""
        if not self.turns:
            return
        decoding = sum(r.state is RowState.DECODING for r in call.rows)
        if self.batch and decoding and len(self.turns) * 4 < decoding \
                and time.monotonic() - self.since < self.prefill_s:
            return
        start = time.monotonic()
        stats["tool_turn_prefills"] += call.resume_rows(self.turns)
        self.prefill_s = time.monotonic() - start
        self.turns = []
