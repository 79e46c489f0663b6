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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from qerl.rollout.sampling import decode_ids
from qerl.rollout.verify import verify

__all__ = ["Row", "SpeculativeRows", "MAX_QUERIES"]

MAX_QUERIES = 8  # the last token and up to 7 drafts per row and step


@dataclass
class Row:
    """One live row of the call: where it is in the cache, what it has generated, how it samples."""

    index: int  # the call's row (its prompt's place)
    slot: int  # its cache row
    write: int  # the cache slot of `last`, which is not in the cache yet
    position: int  # the RoPE position of `last`
    count: int  # tokens generated so far, `last` included
    last: int  # the newest token: the first input of the next step
    key: int  # its sampling key (`qerl.rollout.verify.uniforms`)
    draft_len: int = 4
    tokens: list[int] = field(default_factory=list)  # generated in this phase
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None  # eos / stop / length once finished
    proposed: int = 0  # drafted tokens, how many were accepted, and steps that rejected one (acceptance stats)
    accepted: int = 0
    rejections: int = 0

    def advance(self, emitted: list[int], logprobs: list[float], eos: set[int], max_new: int,
                stop: Callable[["Row", int], bool]) -> None:
        """Take a step's emitted tokens, ending the row at an EOS, a stop string or the length limit."""
        for token, logprob in zip(emitted, logprobs):
            self.tokens.append(token)
            self.logprobs.append(logprob)
            self.count += 1
            if token in eos:
                self.reason = "eos"
            elif stop(self, token):
                self.reason = "stop"
            elif self.count >= max_new:
                self.reason = "length"
            if self.reason is not None:
                return
        n = len(emitted)
        self.write, self.position, self.last = self.write + n, self.position + n, emitted[-1]

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


class SpeculativeRows:
    """The tail of one `RolloutEngine.generate` call, speculatively decoded. `engine` provides the caches, the verify
    step and compaction; `call` is what the call samples with (its drafts, tokenizer, limits, sampling settings)."""

    def __init__(self, engine: Any, call: Any, rows: list[Row], bucket: int):
        self.engine, self.call, self.rows, self.bucket = engine, call, rows, bucket
        self.stop_window = max((len(s) for s in call.stop_strings), default=0) + 8

    def run(self) -> list[Row]:
        """Decode until every row has finished, or until the call's `stop_early` (asked after each step with the
        call's rows still live) says to stop; returns the rows (with their tokens of this phase; those still live
        then have no reason)."""
        live, done = list(self.rows), []
        stop_early = getattr(self.call, "stop_early", None)
        while live:
            self.step(live)
            done += [r for r in live if r.reason is not None]
            live = [r for r in live if r.reason is None]
            if live and stop_early is not None and stop_early([r.index for r in live]):
                break
            if live and self.engine.bucket(len(live)) < self.bucket:
                self.bucket = self.engine.compact_rows(live, self.bucket)
        return self.rows

    def step(self, live: list[Row]) -> None:
        """One verify forward for every live row, then the rejection rule, then one sync."""
        call, engine = self.call, self.engine
        drafts = [call.drafts.propose(r.index, min(r.draft_len, call.max_new - r.count))
                  if call.drafts is not None else [] for r in live]
        t = self.queries(live, drafts)
        drafts = [d[:t - 1] for d in drafts]
        engine.verify_inputs(live, drafts, self.bucket, t, call.prompt_len)
        logits = engine.verify_step(self.bucket, t, max(r.write for r in live) + t).view(self.bucket, t, -1)
        n = len(live)
        logits = logits[torch.tensor([r.slot for r in live], device=logits.device)]  # [n, t, V], a copy
        if call.logits_processor is not None:
            rows = torch.tensor([r.index for r in live], device=logits.device).repeat_interleave(t)
            at = (torch.tensor([r.count for r in live], device=logits.device)[:, None]
                  + torch.arange(t, device=logits.device)).view(-1)
            call.logits_processor(logits.view(n * t, -1), rows, at)
        dev = logits.device
        draft_t = torch.zeros(n, max(1, t - 1), dtype=torch.long)
        for i, d in enumerate(drafts):
            draft_t[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        info = torch.tensor([[len(d), r.key, r.count] for d, r in zip(drafts, live)], dtype=torch.long).to(dev)
        out, logprobs, accepted = verify(logits, draft_t[:, :t - 1].to(dev), info[:, 0], info[:, 1], info[:, 2],
                                         call.temperature, call.top_p, call.top_k)
        host = torch.cat([out, accepted[:, None]], 1).tolist()  # the step's one sync
        host_lp = logprobs.tolist()
        for r, d, row, lp in zip(live, drafts, host, host_lp):
            a = row[-1]
            r.advance(row[:a + 1], lp[:a + 1], call.eos, call.max_new, self._stopped)
            r.adapt(len(d), a, call.max_draft)
            if call.drafts is not None:
                call.drafts.extend(r.index, row[:a + 1])
        engine.stats["spec_row_steps"] += n
        engine.record(sum(r.reason is None for r in live))

    def queries(self, live: list[Row], drafts: list[list[int]]) -> int:
        """Query tokens per row for this step (1, 2, 4 or 8): the most expected tokens per unit of step cost. A row
        with d drafts at acceptance a gains (1 - a^(d+1)) / (1 - a) tokens; the step costs 1 + c * rows * queries,
        c = `engine.verify_token_cost` (a query token's share of a step's fixed cost: the weights it streams). At a
        few rows and good drafts that is 8; with poor drafts or many rows, fewer."""
        longest = max(map(len, drafts))
        rates = [min(r.acceptance(), 0.999) for r in live]
        rows, cost = self.bucket, self.engine.verify_token_cost
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
        call = self.call
        if not call.stop_strings:
            return False
        history = call.host_tokens[row.index]
        history.append(token)
        tail = decode_ids(call.tokenizer, history[-self.stop_window:])
        return any(s in tail for s in call.stop_strings)
