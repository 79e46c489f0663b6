"""The lockstep phase of a call: every live row advances one token per step, all at one cache slot.

Each step is one decode (a CUDA graph replay per batch bucket and KV window) and one eager draw for the cache rows
:width; EOS rows are flagged done on the device (`engine.done`) and feed filler from then on. Nothing is read back
per token: every `check_every` steps one host check reads the done flags, scans the new tokens for stop strings and
returns the rows still live, so the call can compact them into a smaller bucket, hand them to the speculative
tail, pause one for a tool, or stop. A step's token for row r is the call's token `step` of r (rows in lockstep
started together), so the outputs are written a column per step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from qerl.rollout.call import CallOutputs, CallSettings
from qerl.rollout.rows import Row, RowState, SlotTable
from qerl.rollout.sampling import decode_ids, sample_tokens, step_keys

__all__ = ["LockstepRows"]


class LockstepRows:
    """The rows of `table` in lockstep, from step 0 (their prompts prefilled, logits in `engine.logits_buf`).
    `generator`: without `row_seeds`, the call's one generator (or None: the global RNG) that every row draws from."""

    def __init__(self, engine: Any, settings: CallSettings, table: SlotTable, outputs: CallOutputs, generator):
        self.engine, self.settings, self.table, self.outputs = engine, settings, table, outputs
        self.generator = generator
        self.step, self.scanned = 0, 0  # the step being drawn; steps already scanned for stop strings
        self.fed = False  # the step's token is in tok_in, its decode still to run
        self.ended = False  # the call's last step has been drawn
        self.bar = tqdm(total=settings.max_new, desc="generate", unit="tok", disable=not settings.progress)
        per_row = any(r is not None and r.generator is not None for r in table.rows)
        # padding rows draw from a generator of their own (their draws are discarded)
        self.spare = torch.Generator(device=engine.device) if per_row else None
        self.refresh_draws()

    @property
    def rows(self) -> list[Row]:
        return [r for r in self.table.rows if r is not None]

    def refresh_draws(self) -> None:
        """Each cache row draws from its row's generator (or kernel key), so a row's tokens do not depend on its
        cache row; called again after every compaction."""
        rows = self.table.rows
        if self.spare is None:
            self.draw_from, self.seeds, self.offsets = self.generator, None, None
            return
        dev = self.engine.device
        self.draw_from = [r.generator if r is not None else self.spare for r in rows]
        self.seeds = torch.tensor([r.seed if r is not None else 0 for r in rows], dtype=torch.long, device=dev)
        carried = [len(r.earlier) if r is not None else 0 for r in rows]  # a carried row's keys go on from its index
        self.offsets = torch.tensor(carried, dtype=torch.long, device=dev) if any(carried) else None

    def advance(self) -> list[Row]:
        """Decode and draw up to the next host check; returns the rows live there (in cache-row order), or [] with
        `ended` once the call's last step is drawn."""
        engine, check_every = self.engine, self.engine.check_every
        while True:
            if self.fed:
                self.decode()
            token = self.draw()
            self.bar.update()
            if self.step + 1 == self.settings.max_new:
                self.ended = True
                return []
            engine.tok_in[:self.table.width].copy_(token)
            self.fed = True
            # step 0: a speculative call (or one with tools) hands its rows to the phase outside lockstep at once
            at_once = engine.speculative or self.settings.tools is not None
            if (self.step + 1) % check_every == 0 or (self.step == 0 and at_once):
                live = self.check()
                engine.record(len(live))
                return live

    def draw(self) -> Tensor:
        """The step's token for every cache row: sampled, filler where done; written to the outputs, EOS flagged."""
        engine, s, out, width, step = self.engine, self.settings, self.outputs, self.table.width, self.step
        keys = None
        if self.seeds is not None:
            keys = step_keys(self.seeds, step) if self.offsets is None else step_keys(self.seeds, self.offsets + step)
        if s.logits_processor is not None:
            s.logits_processor(engine.logits_buf[:width], engine.row_map[:width],
                               torch.full((width,), step, dtype=torch.long, device=engine.device))
        token, logprob = sample_tokens(engine.logits_buf[:width], s.temperature, s.top_p, s.top_k, self.draw_from,
                                       keys)
        done, where = engine.done[:width], engine.row_map[:width]
        token = token.masked_fill(done, s.filler)
        out.tokens[where, step] = token
        out.logprobs[where, step] = logprob
        if out.eos is not None:
            newly = ~done & torch.isin(token, out.eos)
            out.first_eos[where] = torch.where(newly, step, out.first_eos[where])
            done |= newly
        return token

    def decode(self) -> None:
        """Feed the step's tokens (in tok_in): their KV at the step's slot, the next logits."""
        engine, width, slot = self.engine, self.table.width, self.settings.prompt_len + self.step
        engine.pos_in[:width] += 1
        engine.slot.fill_(slot)  # the slot of the token sampled at `step`
        engine.decode(width, engine.window_of(slot + 1))
        engine.stats["steps"] += 1
        self.step, self.fed = self.step + 1, False

    def check(self) -> list[Row]:
        """The one sync: done flags, stop strings in steps scanned..step, budgets; the rows still decoding."""
        engine, width, step = self.engine, self.table.width, self.step
        done = engine.done[:width].tolist()
        changed = self.scan_stop_strings(done) | self.end_at_budgets(done)
        if changed:
            engine.done[:width].copy_(torch.tensor(done))
        live = []
        for slot, row in enumerate(self.table.rows):
            if row is None:
                continue
            if not done[slot]:
                live.append(row)
            elif row.state is RowState.DECODING:
                row.state = RowState.FINISHED
        return live

    def scan_stop_strings(self, done: list[bool]) -> bool:
        """Copy steps scanned..step to each row's history and scan them (up to its EOS) for stop strings; rows that
        stop are marked in `done`. True when the flags were rescanned (they are then written back)."""
        s, upto = self.settings, self.step
        if not s.stop_strings or upto < self.scanned:
            return False
        batch = self.outputs.batch
        new = self.outputs.tokens[:batch, self.scanned:upto + 1].tolist()
        eos_steps = self.outputs.first_eos[:batch].tolist()
        for slot, row in enumerate(self.table.rows):
            if row is None:
                continue
            last = min(upto, eos_steps[row.index] - 1)
            if row.scan_for_stop(new[row.index], self.scanned, last, s.tokenizer, s.stop_strings, s.stop_window,
                                 decode_ids):
                done[slot] = True
        self.scanned = upto + 1
        return True

    def end_at_budgets(self, done: list[bool]) -> bool:
        """Rows whose budget is below the call's steps (carried rows) end at it: marked in `done`; their tokens past
        it are dropped when the call is read back (as those past a stop string)."""
        changed = False
        for slot, row in enumerate(self.table.rows):
            if row is not None and not done[slot] and self.step + 1 >= row.budget:
                done[slot] = changed = True
        return changed

    def finish(self) -> None:
        """The call's last scan for stop strings (the steps since the last check)."""
        self.bar.close()
        if self.settings.stop_strings:
            self.check()

    def leave(self, rows: list[Row]) -> None:
        """Give `rows` (live at the check just made) their own slot, position and last token, in one copy to the
        host, so they advance outside lockstep from the step's token on."""
        engine, step = self.engine, self.step
        positions, last = engine.pos_in[:self.table.width, 0].tolist(), engine.tok_in[:self.table.width].tolist()
        for r in rows:
            r.leave_lockstep(write=self.settings.prompt_len + step, position=positions[r.slot] + 1, count=step + 1,
                             last=last[r.slot])

    def hold(self, row: Row) -> None:
        """Keep `row` out of the coming steps (waiting for a tool): it feeds filler as a finished row does, while
        its cache row is kept at compaction."""
        self.engine.done[row.slot] = True
