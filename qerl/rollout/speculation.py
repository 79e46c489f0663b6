"""Speculative decoding of a rollout's tail: rows as objects, each advancing by as many tokens as its drafts earn.

A ragged rollout spends most of its decode steps at a handful of live rows (a few long completions of a group),
where one step streams every weight for a few tokens. There the engine hands its live rows to `SpeculativeRows`:
each step, every row proposes up to k tokens from text the run already has (`qerl.rollout.drafts`), one forward
verifies them all (`Transformer.decode_step` with several query tokens per row, graph-captured like the plain step)
and the rejection rule of `qerl.rollout.verify` keeps what the policy would have sampled, so a row gains 1 to k + 1
tokens for about the price of one. Rows now differ in length, so each row keeps its own cache slot, RoPE position
and draft length (grown when all its drafts were accepted, shrunk to what was accepted otherwise).

Each step syncs once (the accepted counts decide the next drafts); at a few rows that costs far less than the
tokens it wins. Finished rows leave, and live rows move to a smaller bucket as in the plain loop.

The same phase carries any row that cannot stay in lockstep (`qerl.rollout.lockstep`, one slot for every row): a row
resumed after a tool call is longer than its neighbours by the tool's tokens. Without drafts a step is one query per
row (the verify step with t = 1); a row waiting for a tool keeps its cache row and is not advanced.
"""
from __future__ import annotations

from typing import Any

import torch

from qerl.rollout.rows import Row, RowState, SlotTable
from qerl.rollout.sampling import decode_ids, sample_tokens, step_keys
from qerl.rollout.verify import verify

__all__ = ["SpeculativeRows", "MAX_QUERIES"]

MAX_QUERIES = 8  # the last token and up to 7 drafts per row and step


class SpeculativeRows:
    """The rows of a call outside lockstep (each at its own slot and position): the speculative tail, and rows
    resumed after a tool. `engine` provides the caches, the verify step and compaction; `settings` is what the call
    samples with (its drafts, tokenizer, limits, sampling settings); `table` the call's cache rows, whose decoding
    rows advance (a row waiting for a tool keeps its cache row and is not advanced)."""

    def __init__(self, engine: Any, settings: Any, table: SlotTable):
        self.engine, self.settings, self.table = engine, settings, table

    @property
    def decoding(self) -> list[Row]:
        return [r for r in self.table.rows if r is not None and r.state is RowState.DECODING]

    @property
    def waiting(self) -> list[Row]:
        return [r for r in self.table.rows if r is not None and r.state is RowState.WAITING_FOR_TOOL]

    def compact(self) -> None:
        """Move the rows still needed (decoding or waiting for a tool) into a smaller bucket when they fit one. Not
        in a call with tools on exact shapes: when rows finish there depends on how long tools take, and the batch's
        shape would carry that into the float rounding of every row (the reference's rollouts are bit-exact)."""
        if self.engine.exact and self.settings.tools is not None:
            return
        keep = [r for r in self.table.rows if r is not None and r.state in (RowState.DECODING,
                                                                            RowState.WAITING_FOR_TOOL)]
        if keep and self.engine.bucket(len(keep)) < self.table.width:
            self.table.compact(keep)

    def step(self, live: list[Row]) -> None:
        """One verify forward for every live row, then the rejection rule (or, for rows of a call with tools, the
        lockstep phase's draw), then one sync."""
        call, engine = self.settings, self.engine
        drafts = [call.drafts.propose(r.index, min(r.draft_len, r.budget - r.count))
                  if call.drafts is not None else [] for r in live]
        t = self.queries(live, drafts)
        drafts = [d[:t - 1] for d in drafts]
        logits = self._logits(live, drafts, t)
        if t == 1 and call.tools is not None and all(r.generator is not None for r in live):
            host, host_lp = self._draw(live, logits[:, 0])
        else:
            host, host_lp = self._verify(live, drafts, logits, t)
        for r, d, row, lp in zip(live, drafts, host, host_lp):
            a = row[-1]
            r.advance(row[:a + 1], lp[:a + 1], call.eos, self._stopped, call.tools)
            r.adapt(len(d), a, call.max_draft)
            if call.drafts is not None:
                call.drafts.extend(r.index, row[:a + 1])
        engine.stats["spec_row_steps"] += len(live)
        engine.record(sum(r.reason is None for r in live))

    def _logits(self, live: list[Row], drafts: list[list[int]], t: int):
        """The verify forward's fp32 logits [rows, t, V] of the live rows (after the call's logits processor)."""
        call, engine, width = self.settings, self.engine, self.table.width
        waiting = self.waiting  # fed at their own slots (past what they hold), so their cache rows are kept
        engine.verify_inputs(live, drafts, width, t, call.prompt_len, waiting)
        logits = engine.verify_step(width, t, max(r.write for r in live + waiting) + t).view(width, t, -1)
        n = len(live)
        logits = logits[torch.tensor([r.slot for r in live], device=logits.device)]  # [n, t, V], a copy
        if call.logits_processor is not None:
            rows = torch.tensor([r.index for r in live], device=logits.device).repeat_interleave(t)
            at = (torch.tensor([r.drawn for r in live], device=logits.device)[:, None]
                  + torch.arange(t, device=logits.device)).view(-1)
            call.logits_processor(logits.view(n * t, -1), rows, at)
        return logits

    def _verify(self, live: list[Row], drafts: list[list[int]], logits, t: int):
        """The rejection rule over each row's drafts (counter-keyed draws); per row [tokens..., accepted] and the
        tokens' log-probs, on the host."""
        call, n, dev = self.settings, len(live), logits.device
        draft_t = torch.zeros(n, max(1, t - 1), dtype=torch.long)
        for i, d in enumerate(drafts):
            draft_t[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        info = torch.tensor([[len(d), r.key, r.drawn] for d, r in zip(drafts, live)], dtype=torch.long).to(dev)
        out, logprobs, accepted = verify(logits, draft_t[:, :t - 1].to(dev), info[:, 0], info[:, 1], info[:, 2],
                                         call.temperature, call.top_p, call.top_k)
        return torch.cat([out, accepted[:, None]], 1).tolist(), logprobs.tolist()  # the step's one sync

    def _draw(self, live: list[Row], logits):
        """One token per row as the lockstep phase draws it (`sample_tokens`: the row's generator on the CPU, the
        one-pass kernel keyed by its seed and completion index on CUDA): a row of a call with tools that makes no
        call samples what it would in a call without tools; each draw is its own, whatever the other rows do."""
        call, dev = self.settings, logits.device
        seeds = torch.tensor([r.seed for r in live], dtype=torch.long, device=dev)
        keys = step_keys(seeds, torch.tensor([r.drawn for r in live], dtype=torch.long, device=dev))
        tokens, logprobs = sample_tokens(logits, call.temperature, call.top_p, call.top_k,
                                         [r.generator for r in live], keys)
        host = torch.stack([tokens, torch.zeros_like(tokens)], 1).tolist()  # the step's one sync
        return host, logprobs[:, None].tolist()

    def queries(self, live: list[Row], drafts: list[list[int]]) -> int:
        """Query tokens per row for this step (1, 2, 4 or 8): the most expected tokens per unit of step cost. A row
        with d drafts at acceptance a gains (1 - a^(d+1)) / (1 - a) tokens; the step costs 1 + c * rows * queries,
        c = `engine.verify_token_cost` (a query token's share of a step's fixed cost: the weights it streams). At a
        few rows and good drafts that is 8; with poor drafts or many rows, fewer."""
        longest = max(map(len, drafts))
        rates = [min(r.acceptance(), 0.999) for r in live]
        rows, cost = self.table.width, self.engine.verify_token_cost
        best, best_t = -1.0, 1
        for t in (1, 2, 4, MAX_QUERIES):
            if t // 2 > longest:
                break  # the last size already held every draft: the same tokens for more cost
            gain = sum((1 - a ** (min(len(d), t - 1) + 1)) / (1 - a) for a, d in zip(rates, drafts))
            value = gain / (1 + cost * rows * t)
            if value > best:
                best, best_t = value, t
        return best_t

    def _stopped(self, row: Row, token: int) -> bool:
        """Whether the row's completion now ends in one of the call's stop strings (as the plain loop scans)."""
        call = self.settings
        if not call.stop_strings:
            return False
        row.history.append(token)
        tail = decode_ids(call.tokenizer, row.history[-call.stop_window:])
        return any(s in tail for s in call.stop_strings)
