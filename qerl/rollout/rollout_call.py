"""One engine call in progress: its rows, which phase advances them, and what a caller may do between host checks.

A call starts in lockstep (`qerl.rollout.lockstep`: one graph replay per token for every live row, a host check
every `check_every` steps). At a check it may stop early (`CallSettings.stop_early`), compact its live rows into a
smaller bucket, or hand them to the rows-outside-lockstep phase (`qerl.rollout.speculation.SpeculativeRows`: the
speculative tail, each row at its own slot). Between checks a caller driving the call (`RolloutEngine.open`) may
`pause` a row for a tool call (it keeps its cache row and is not advanced), `resume` it with the tool's tokens
(prefilled from its cache; the call then goes on outside lockstep, where rows may differ in length), or
`hand_back` its unfinished rows, which a later call continues (`carried`).

A call with tools (`CallSettings.tools`) leaves lockstep after its first token: every row then decodes at its own
slot, draws as lockstep would (`SpeculativeRows._draw`) but only when it decodes, and pauses itself at a tool call's
closing tag (`Row.advance`). So a row samples the same tokens however long the tools of other rows take (in
lockstep, the first resume would move the call out at a time set by a tool's latency, and the draws with it); after
the first tool call of a multi-turn rollout nearly every row is outside lockstep anyway. `tool_calls` gives the rows
that newly wait, `resume` continues one with its tool turn, `end_turns` ends one at its call (out of turns or of
budget).
"""
from __future__ import annotations

from typing import Any

import torch

from qerl.rollout.call import CallOutputs, CallSettings, GroupCut
from qerl.rollout.lockstep import LockstepRows
from qerl.rollout.rows import Row, RowState, SlotTable
from qerl.rollout.sampling import Rollout
from qerl.rollout.speculation import SpeculativeRows

__all__ = ["RolloutCall"]


class RolloutCall:
    """The call's rows (in the call's order), prefilled; `advance` until it returns False, then `result`.
    `generator`: the call's one generator without `row_seeds` (or None: the global RNG)."""

    def __init__(self, engine: Any, settings: CallSettings, rows: list[Row], generator, cut: GroupCut | None):
        self.engine, self.settings, self.rows, self.generator, self.cut = engine, settings, rows, generator, cut
        self.outputs = CallOutputs(len(rows), settings, engine.device)
        self.table = SlotTable(engine, rows + [None] * (engine.bucket(len(rows)) - len(rows)))
        engine.prefill_call(self.table.rows, settings)
        for r in rows:
            r.state = RowState.DECODING
        self.lockstep = LockstepRows(engine, settings, self.table, self.outputs, generator)
        self.outside: SpeculativeRows | None = None  # the phase of rows outside lockstep, once it began
        self.stopped = False
        self.handed_back: set[int] = set()
        self._dispatched: set[int] = set()  # rows whose tool call `tool_calls` has given out
        engine.record(len(rows))

    def run(self) -> None:
        """Advance until nothing can (every row finished or waiting for a tool, or the call stopped early)."""
        while self.advance():
            pass

    def advance(self) -> bool:
        """Up to the next host check (a step outside lockstep); False once nothing can advance now."""
        if self.stopped:
            return False
        return self._advance_lockstep() if self.outside is None else self._advance_outside()

    @property
    def waiting(self) -> list[Row]:
        return [r for r in self.rows if r.state is RowState.WAITING_FOR_TOOL]

    def _advance_lockstep(self) -> bool:
        engine, lockstep = self.engine, self.lockstep
        live = lockstep.advance()
        if lockstep.ended:
            lockstep.finish()
            for r in lockstep.rows:
                if r.state is RowState.DECODING:
                    r.state = RowState.FINISHED
        if not live:
            return self._idle()
        if self._stops_early(live):
            return False
        if self.settings.tools is not None:
            self._leave_lockstep(live)
            return True
        keep = live + self.waiting
        if engine.speculative and len(live) <= engine.speculative_rows:
            if engine.bucket(len(keep)) < self.table.width:  # (also in exact mode: the tail's rows only)
                self.table.compact(keep)
            self._leave_lockstep(live)
        elif not engine.exact and engine.bucket(len(keep)) < self.table.width:
            self.table.compact(keep)
            lockstep.refresh_draws()
        return True

    def _advance_outside(self) -> bool:
        outside = self.outside
        live = outside.decoding
        if not live:
            return self._idle()
        outside.step(live)
        live = outside.decoding
        if not live:
            return self._idle()
        if self._stops_early(live):
            return False
        outside.compact()
        return True

    def _idle(self) -> bool:
        """No row to advance: the call ends unless rows wait for a tool (they resume, then it goes on)."""
        if not self.waiting:
            self._stop()
        return False

    def _stops_early(self, live: list[Row]) -> bool:
        """Ask `stop_early` with the unfinished rows; when it says stop, they keep the tokens they have (cut)."""
        unfinished = live + self.waiting
        if self.settings.stop_early is None or not self.settings.stop_early([r.index for r in unfinished]):
            return False
        for r in unfinished:
            r.cut_count = self._count(r)
        self._stop()
        return True

    def _count(self, row: Row) -> int:
        """Tokens the row has generated in this call so far."""
        in_lockstep = self.outside is None and row.state is RowState.DECODING
        return self.lockstep.step + 1 if in_lockstep else row.count

    def _stop(self) -> None:
        self.stopped = True
        self.lockstep.bar.close()
        self.engine.record(0)

    def _leave_lockstep(self, live: list[Row]) -> None:
        """Hand `live` to the rows-outside-lockstep phase after this check's token was drawn, before it is fed."""
        call, step = self.settings, self.lockstep.step
        self.lockstep.leave(live)
        self._assign_keys()
        if call.drafts is not None or call.stop_strings or call.tools:  # the rows' tokens so far, in one copy
            for r, ids in zip(live, self.outputs.so_far(live, [step + 1] * len(live))):
                if call.drafts is not None:
                    call.drafts.extend(r.index, ids)
                if call.stop_strings:  # the stop-string scan continues from the tokens lockstep drew
                    r.history = r.earlier + ids
                if call.tools is not None:  # its turn so far (a one-token tag may close at once)
                    r.turn = ids[:-1]
                    r.calls_a_tool(ids[-1], call.tools)
        self.outside = SpeculativeRows(self.engine, call, self.table)

    def _assign_keys(self) -> None:
        """Without `row_seeds`, each row's key for the counter-based draws outside lockstep is drawn now from the
        call's generator (or the global RNG), one per row of the call (with row seeds they come from the seeds)."""
        if all(r.generator is not None for r in self.rows) or self.outside is not None:
            return
        source = self.generator if isinstance(self.generator, torch.Generator) else None
        device = source.device if source is not None else "cpu"
        keys = torch.randint(0, 2**62, (len(self.rows),), generator=source, device=device).tolist()
        for r, key in zip(self.rows, keys):
            r.key = key

    # ------------------------------------------------------------------------------------------------ the hooks

    def pause(self, index: int) -> None:
        """Row `index` (decoding, at a host check) waits for a tool: it is not advanced and keeps its cache row."""
        if self.stopped or (self.outside is None and not self.lockstep.fed):
            raise ValueError("a row pauses at a host check of a running call (after `advance`)")
        row = self.rows[index]
        row.pause()
        if self.outside is None:
            self.lockstep.leave([row])
            self.lockstep.hold(row)

    def resume(self, index: int, appended: list[int]) -> None:
        """Row `index` (waiting for a tool) goes on after the tool's tokens `appended`: they join its completion
        (log-prob 0) and are prefilled from its cache; the call goes on with rows outside lockstep."""
        self.resume_rows([(index, appended)])

    def resume_rows(self, answers: list[tuple[int, list[int]]]) -> int:
        """`resume` for several rows (index, appended) at once: their tool turns are prefilled in one forward
        (`RolloutEngine.extend_rows`), which costs what one row's does. Returns the prefill forwards run."""
        if self.stopped:
            raise ValueError("the call has stopped: a row can no longer resume in it")
        extends = []
        for index, appended in answers:
            row = self.rows[index]
            write, position = row.write, row.position
            missing = row.resume(appended)
            self._dispatched.discard(index)
            extends.append((row.slot, missing, write, position))
        if self.outside is None:
            live = [r for r in self.lockstep.rows if r.state is RowState.DECODING
                    and r.index not in {i for i, _ in answers}]
            self._leave_lockstep(live)
        return self.engine.extend_rows(extends)

    def tool_calls(self) -> list[Row]:
        """The rows that paused at a tool call since the last time this was asked (each row's `tool_call`: its turn's
        tokens, the closing tag last)."""
        new = [r for r in self.waiting if r.tool_call is not None and r.index not in self._dispatched]
        self._dispatched.update(r.index for r in new)
        return new

    def end_turns(self, index: int, truncated: bool = False) -> None:
        """Row `index` (waiting for a tool) ends at its tool call: stop reason stop (it may make no more calls), or
        with `truncated` length (its budget has no room for the tool's answer)."""
        row = self.rows[index]
        if row.state is not RowState.WAITING_FOR_TOOL:
            raise ValueError(f"row {index} is {row.state.value}: only a row waiting for a tool ends at its call")
        row.state, row.tool_call, row.reason = RowState.FINISHED, None, "length" if truncated else "stop"
        self._dispatched.discard(index)
        if truncated:
            row.budget = row.count  # the rollout cuts it here, as at its length limit

    def hand_back(self) -> list[Row]:
        """End the call here; its unfinished rows come back as rows a later call continues (`carried`), their
        tokens so far in `earlier` and their draws going on from there. In this call's result they are cut."""
        unfinished = [r for r in self.rows if r.state in (RowState.DECODING, RowState.WAITING_FOR_TOOL)]
        if any(r.generator is None for r in unfinished):
            raise ValueError("only rows with their own generator (row_seeds) can be continued by a later call")
        for r in unfinished:
            r.cut_count = self._count(r)
        self._stop()
        self._write_back()
        tokens, logprobs = self.outputs.so_far(unfinished, [r.cut_count for r in unfinished], logprobs=True)
        self.handed_back = {r.index for r in unfinished}
        return [r.carried(ids, lps) for r, ids, lps in zip(unfinished, tokens, logprobs)]

    # ------------------------------------------------------------------------------------------------ the result

    def _write_back(self) -> None:
        """Rows outside lockstep: their tokens into the call's outputs, their speculation into the engine's stats."""
        moved = [r for r in self.rows if r.phase_start or r.tokens]
        stats = self.engine.stats
        for r in moved:
            stats["drafted"] += r.proposed
            stats["accepted"] += r.accepted
            stats["spec_tokens"] += len(r.tokens) - r.appended
            r.proposed = r.accepted = r.appended = 0
        self.outputs.write_back(moved)

    def result(self) -> Rollout:
        """The call's `Rollout`, in the call's row order (rows of dropped groups, and rows handed back, cut)."""
        if self.waiting:
            raise ValueError(f"rows {[r.index for r in self.waiting]} wait for a tool: resume or hand them back")
        self._write_back()
        dropped = (self.cut.dropped() if self.cut is not None else set()) | self.handed_back
        return self.outputs.rollout(self.settings.tokenizer, self.rows, dropped)
