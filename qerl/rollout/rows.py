"""The rows of a rollout call as objects: each row's tokens, its cache row, its sampling key and its state, and the
table of which row each cache row holds.

One `Row` type serves every phase of a call. In the lockstep phase (`qerl.rollout.lockstep`) all live rows share one
cache slot per step and their tokens stay on the device until a host check, so a row there holds only what the host
needs at a check (its cache row, its draws, what it scanned for stop strings). A row that leaves lockstep (the
speculative tail, a row resumed after a tool call) takes its own write slot, RoPE position and last token, and from
then on advances by as many tokens as a step gives it (`advance`).

States: prefilling (its prompt is being written to the cache), decoding, waiting_for_tool (not advanced; it keeps
its cache row until `resume` appends the tool's tokens), finished. A row of a call with tools (`ToolStop`) pauses
itself when the text of its current turn completes the tool-call format's closing tag (`advance`), so the caller can
run the call and resume it with the tool turn's tokens. A row handed back unfinished carries its tokens
(`earlier`) and draws (its generator) into a later call, which prefills its prompt and those tokens again and
continues it as if the call had never stopped.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Row", "RowState", "SlotTable", "ToolStop"]


class RowState(enum.Enum):
    PREFILLING = "prefilling"
    DECODING = "decoding"
    WAITING_FOR_TOOL = "waiting_for_tool"
    FINISHED = "finished"


@dataclass(frozen=True)
class ToolStop:
    """Where a row of a call with tools stops for a tool call: once the decoded text of its current turn's last
    `window` tokens holds `close` (the format's closing tag). Only a token in `candidates` (those whose text holds the
    tag's last character; None: any) can complete it, so most tokens cost no decode."""

    close: str
    candidates: frozenset[int] | None
    window: int
    decode: Callable[[list[int]], str]  # token ids -> text, special tokens kept

    def completes(self, turn: list[int]) -> bool:
        """Whether the newest token of `turn` (the tokens generated since its turn began) completes the tag."""
        if self.candidates is not None and turn[-1] not in self.candidates:
            return False
        return self.close in self.decode(turn[-self.window:])


@dataclass(eq=False)
class Row:
    """One row of a call: its prompt, where it is in the cache, what it has generated, how it samples."""

    index: int  # the call's row (its prompt's place in the call)
    prompt: list[int]
    key: int  # its key for the verify step's counter-based draws (`qerl.rollout.verify.uniforms`)
    budget: int  # the most tokens it may generate in this call (its length limit less `earlier`)
    generator: torch.Generator | None = None  # its own generator (`row_seeds`); None: the call's
    seed: int | None = None  # its seed for the sampling kernel's keys (`sampling.step_keys`), with `row_seeds`
    earlier: list[int] = field(default_factory=list)  # tokens it generated in earlier calls (a carried row)
    earlier_logprobs: list[float] = field(default_factory=list)
    state: RowState = RowState.PREFILLING
    slot: int = -1  # its cache row (-1: none)
    # What a row outside lockstep advances from (set when it leaves lockstep, `leave_lockstep`)
    write: int = 0  # the cache slot of `last`, which is not in the cache yet
    position: int = 0  # the RoPE position of `last`
    count: int = 0  # tokens generated in this call so far, `last` included
    last: int = 0  # the newest token: the first input of the next step
    phase_start: int = 0  # `count` when it left lockstep: `tokens` continue the call's outputs from there
    tokens: list[int] = field(default_factory=list)  # generated (or appended by a tool) since it left lockstep
    logprobs: list[float] = field(default_factory=list)
    appended: int = 0  # of `tokens`, those a tool appended
    reason: str | None = None  # eos / stop / length once finished outside lockstep
    history: list[int] = field(default_factory=list)  # its tokens scanned for stop strings so far
    stop_at: int | None = None  # the call's index of the token that completed a stop string
    cut_count: int | None = None  # tokens it had when the call stopped early (`stop_early`) or handed it back
    draft_len: int = 4
    proposed: int = 0  # drafted tokens, how many were accepted, and steps that rejected one (acceptance stats)
    accepted: int = 0
    rejections: int = 0
    # Tool calls (a call with a `ToolStop`)
    turn: list[int] = field(default_factory=list)  # its tokens since its current turn began (after the last tool)
    tool_call: list[int] | None = None  # the turn's tokens while it waits for its tool call to be run
    turns: int = 0  # tool turns appended so far
    injected: list[int] = field(default_factory=list)  # this call's indices of the tokens tools appended

    @property
    def context(self) -> list[int]:
        """What its prefill writes to the cache: the prompt, then the tokens of earlier calls."""
        return self.prompt + self.earlier

    @property
    def drawn(self) -> int:
        """Its completion index of the next token it draws (earlier calls' tokens counted): the position its
        counter-based draws are keyed by, so a carried row never reuses a key."""
        return len(self.earlier) + self.count

    def leave_lockstep(self, write: int, position: int, count: int, last: int) -> None:
        """Take its own slot, position and last token: from now on it advances by itself."""
        self.write, self.position, self.count, self.last = write, position, count, last
        self.phase_start, self.tokens, self.logprobs = count, [], []

    def advance(self, emitted: list[int], logprobs: list[float], eos: set[int],
                stop: Callable[["Row", int], bool], tools: ToolStop | None = None) -> None:
        """Take a step's emitted tokens, ending the row at an EOS, a stop string or its budget; with `tools`,
        pausing it (waiting for a tool, `tool_call` set) at a token that completes a tool call's closing tag."""
        for n, (token, logprob) in enumerate(zip(emitted, logprobs), 1):
            self.tokens.append(token)
            self.logprobs.append(logprob)
            self.count += 1
            if token in eos:
                self.reason = "eos"
            elif stop(self, token):
                self.reason = "stop"
            elif tools is not None and self.calls_a_tool(token, tools):
                break
            elif self.count >= self.budget:
                self.reason = "length"
            if self.reason is not None:
                self.state = RowState.FINISHED
                return
        self.write, self.position, self.last = self.write + n, self.position + n, emitted[n - 1]

    def calls_a_tool(self, token: int, tools: ToolStop) -> bool:
        """Add `token` to its turn; True (and waiting for the tool) when it completes the closing tag. At its budget
        it waits too: the caller ends it there (no room for a tool's answer)."""
        self.turn.append(token)
        if not tools.completes(self.turn):
            return False
        self.tool_call, self.state = list(self.turn), RowState.WAITING_FOR_TOOL
        return True

    def pause(self) -> None:
        """Wait for a tool: not advanced, its cache row kept, until `resume`."""
        if self.state is not RowState.DECODING:
            raise ValueError(f"row {self.index} is {self.state.value}: only a decoding row can wait for a tool")
        self.state = RowState.WAITING_FOR_TOOL

    def resume(self, appended: list[int]) -> list[int]:
        """Append a tool's tokens (in its completion with log-prob 0: not sampled) and decode again; returns the
        tokens its cache still lacks (its last token and the appended ones but the new last), which the caller
        prefills at its slots from `write` on."""
        if self.state is not RowState.WAITING_FOR_TOOL:
            raise ValueError(f"row {self.index} is {self.state.value}: only a row waiting for a tool resumes")
        if not appended or self.count + len(appended) >= self.budget:
            raise ValueError(f"row {self.index}: 1 to {self.budget - self.count - 1} tokens can be appended (its "
                             f"budget is {self.budget}, {self.count} used), got {len(appended)}")
        missing = [self.last] + appended[:-1]
        self.injected += range(self.count, self.count + len(appended))
        self.turn, self.tool_call, self.turns = [], None, self.turns + 1
        self.appended += len(appended)
        self.tokens += appended
        self.logprobs += [0.0] * len(appended)
        self.history += appended
        self.count += len(appended)
        self.write, self.position, self.last = self.write + len(missing), self.position + len(missing), appended[-1]
        self.state = RowState.DECODING
        return missing

    def carried(self, tokens: list[int], logprobs: list[float]) -> "Row":
        """This row for a later call, after `tokens` (with `logprobs`) of this one: its prompt, key and draws, its
        budget less what it used; the later call numbers it and prefills its prompt and all its tokens."""
        earlier = self.earlier + tokens
        return Row(index=-1, prompt=self.prompt, key=self.key, budget=self.budget - len(tokens),
                   generator=self.generator, seed=self.seed, earlier=earlier,
                   earlier_logprobs=self.earlier_logprobs + logprobs, history=list(earlier))

    def scan_for_stop(self, new: list[int], first: int, last: int, tokenizer: Any, stop_strings: tuple[str, ...],
                      window: int, decode: Callable[[Any, list[int]], str]) -> bool:
        """Append the call's tokens `new` (indices first.. of this call) to its history and scan indices
        first..last for a stop string, the text of the `window` tokens ending at each; True (and `stop_at` set) at
        the first that completes one. The exact per-step semantics of a scan after every token."""
        self.history.extend(new)
        if self.stop_at is not None:
            return False
        offset = len(self.earlier)
        for j in range(first, last + 1):
            end = offset + j + 1
            tail = decode(tokenizer, self.history[max(0, end - window):end])
            if any(s in tail for s in stop_strings):
                self.stop_at = j
                return True
        return False

    def adapt(self, proposed: int, accepted: int, max_draft: int) -> None:
        """Draft length for the next step: longer after a fully accepted draft, what was accepted (+1) otherwise."""
        self.proposed, self.accepted = self.proposed + proposed, self.accepted + accepted
        self.rejections += accepted < proposed
        if proposed:
            self.draft_len = min(max_draft, self.draft_len + 2) if accepted == proposed else max(1, accepted + 1)

    def acceptance(self) -> float:
        """Its estimated chance that a draft token is accepted (given the ones before it were): accepted tokens over
        accepted tokens plus rejections (a geometric run's estimate), with one of each assumed up front."""
        return (self.accepted + 1) / (self.accepted + self.rejections + 2)


class SlotTable:
    """The row in each of the cache rows :width a step computes (None: a padding row), and compaction: the rows
    still needed move to the front of a smaller bucket (`engine.move_rows` gathers their KV and static inputs) and
    take the cache row they land in."""

    def __init__(self, engine: Any, rows: list[Row | None]):
        self.engine, self.rows = engine, rows
        for slot, row in enumerate(rows):
            if row is not None:
                row.slot = slot

    @property
    def width(self) -> int:
        return len(self.rows)

    def compact(self, keep: list[Row]) -> None:
        """Move `keep` to the front of the next bucket, filled up with other (finished or padding) rows."""
        new_width = self.engine.bucket(len(keep))
        front = sorted(r.slot for r in keep)
        taken = set(front)
        order = front + [s for s in range(self.width) if s not in taken][:new_width - len(front)]
        self.engine.move_rows(order, new_width)
        for row in self.rows:
            if row is not None:
                row.slot = -1
        self.rows = [self.rows[s] for s in order]
        for slot, row in enumerate(self.rows):
            if row is not None:
                row.slot = slot
