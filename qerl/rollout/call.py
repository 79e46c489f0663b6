"""What one rollout call samples with (`CallSettings`), when it stops early (`GroupCut`), and where its tokens go
(`CallOutputs`: device tensors indexed by the call's row, read back once into a `Rollout`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qerl.rollout.rows import Row, ToolStop
from qerl.rollout.sampling import Rollout, decode_ids

__all__ = ["CallSettings", "GroupCut", "CallOutputs", "LogitsProcessor"]

# logits [N, V] fp32 (changed in place), the call's row of each, the completion index each draws
LogitsProcessor = Callable[[Tensor, Tensor, Tensor], None]


@dataclass
class CallSettings:
    """What one `generate` call samples with, as every phase of it reads it."""

    tokenizer: Any
    max_new: int  # steps of the call: the most tokens any of its rows generates in it
    eos: set[int]
    stop_strings: tuple[str, ...]
    temperature: float
    top_p: float
    top_k: int
    filler: int  # what finished and padding rows feed
    drafts: Any
    logits_processor: LogitsProcessor | None
    max_draft: int
    prompt_len: int  # the longest row's context: cache slots before it hold the left-padded prompts
    progress: bool = False  # a token bar over the lockstep steps
    # Asked after each host check (the lockstep phase's every `check_every` steps, the speculative tail's every step)
    # with the call's rows still live: True ends the call there (`GroupCut.observe`; None: never asked).
    stop_early: Callable[[list[int]], bool] | None = None
    # A call with tools: where a row pauses for a tool call (None: rows never wait for a tool by themselves)
    tools: ToolStop | None = None

    @property
    def stop_window(self) -> int:
        """Tokens decoded per stop-string test: the longest stop string's worth and some (a token is >= 1 char)."""
        return max((len(s) for s in self.stop_strings), default=0) + 8


class GroupCut:
    """Which groups a call with `groups` keeps: it stops at the first host check where `needed` groups have every
    row finished, and keeps `needed` of them, those finished at the earliest check, then the lowest first row."""

    def __init__(self, groups: Sequence[int], needed: int):
        self.groups = list(groups)
        self.members: dict[int, list[int]] = {}
        for row, g in enumerate(self.groups):
            self.members.setdefault(g, []).append(row)
        if not 1 <= needed <= len(self.members):
            raise ValueError(f"groups_needed = {needed}: must be in [1, {len(self.members)}] (the call's groups)")
        self.needed, self.checks = needed, 0
        self.finished_at: dict[int, int] = {}  # group -> the host check that first saw all its rows finished
        self.kept: list[int] | None = None

    def observe(self, live: list[int]) -> bool:
        """A host check with the call's rows still live: True (and `kept` set) once `needed` groups finished."""
        self.checks += 1
        live_set = set(live)
        for g, rows in self.members.items():
            if g not in self.finished_at and live_set.isdisjoint(rows):
                self.finished_at[g] = self.checks
        if len(self.finished_at) < self.needed:
            return False
        order = sorted(self.finished_at, key=lambda g: (self.finished_at[g], self.members[g][0]))
        self.kept = order[:self.needed]
        return True

    def dropped(self) -> set[int]:
        """The call's rows whose group is not kept (the call ran to its end if it never stopped early)."""
        if self.kept is None:  # every row has finished, at this last check
            self.observe([])
        kept = set(self.kept)
        return {i for i, g in enumerate(self.groups) if g not in kept}


class CallOutputs:
    """A call's tokens, log-probs and first EOS step on the device, indexed by the call's row and the call's token
    index; row `batch` is where padding rows write. The lockstep phase writes a column per step; rows that left it
    write theirs back at the end (`write_back`)."""

    def __init__(self, batch: int, settings: CallSettings, device: torch.device):
        max_new, self.batch = settings.max_new, batch
        self.tokens = torch.full((batch + 1, max_new), settings.filler, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((batch + 1, max_new), dtype=torch.float32, device=device)
        self.first_eos = torch.full((batch + 1,), max_new, dtype=torch.long, device=device)
        self.eos = torch.tensor(sorted(settings.eos), dtype=torch.long, device=device) if settings.eos else None
        self.with_tools = settings.tools is not None  # the rollout then says which tokens were generated

    def write_back(self, rows: list[Row]) -> None:
        """The tokens rows generated outside lockstep, at their indices from where they left it."""
        index, at, values, lps = [], [], [], []
        for r in rows:
            index += [r.index] * len(r.tokens)
            at += range(r.phase_start, r.phase_start + len(r.tokens))
            values += r.tokens
            lps += r.logprobs
            if r.reason == "eos":
                self.first_eos[r.index] = r.count - 1
            elif r.reason == "stop":
                r.stop_at = r.count - 1
        if index:
            dev = self.tokens.device
            where = (torch.tensor(index, device=dev), torch.tensor(list(at), device=dev))
            self.tokens[where] = torch.tensor(values, device=dev)
            self.logprobs[where] = torch.tensor(lps, dtype=torch.float32, device=dev)
        for r in rows:
            r.tokens, r.logprobs, r.phase_start = [], [], r.count  # now in the tensors

    def so_far(self, rows: list[Row], counts: list[int], logprobs: bool = False):
        """Each row's first `counts` tokens of this call (and with `logprobs` their log-probs), in one copy to the
        host."""
        width, index = max(counts, default=0), [r.index for r in rows]
        tokens = [ids[:n] for ids, n in zip(self.tokens[index, :width].tolist(), counts)]
        if not logprobs:
            return tokens
        return tokens, [lp[:n] for lp, n in zip(self.logprobs[index, :width].tolist(), counts)]

    def rollout(self, tokenizer: Any, rows: list[Row], dropped: set[int]) -> Rollout:
        """The call's `Rollout`: each row cut at its first EOS, its stop string or its budget, after the tokens of
        its earlier calls; rows in `dropped` (and rows handed back) get stop reason cut with the tokens they had."""
        tokens, logprobs, first_eos = self.tokens[:self.batch].cpu(), self.logprobs[:self.batch].cpu(), \
            self.first_eos[:self.batch].cpu()
        completions, lps, reasons, masks = [], [], [], []
        for r in rows:
            e, s = int(first_eos[r.index]), r.stop_at
            length, reason = r.budget, "length"
            if s is not None and s < e and s < r.budget:
                length, reason = s + 1, "stop"
            elif e < r.budget:
                length, reason = e + 1, "eos"
            if r.index in dropped:
                length, reason = (r.cut_count if r.cut_count is not None else length), "cut"
            completions.append(r.earlier + tokens[r.index, :length].tolist())
            lp = logprobs[r.index, :length].clone()
            lps.append(torch.cat([torch.tensor(r.earlier_logprobs, dtype=torch.float32), lp]) if r.earlier else lp)
            reasons.append(reason)
            masks.append(_generated(r, length))
        return Rollout([r.prompt for r in rows], completions, [decode_ids(tokenizer, c) for c in completions], lps,
                       reasons, generated_mask=masks if self.with_tools else None)


def _generated(row: Row, length: int) -> Tensor:
    """True at the row's completion tokens it sampled (its earlier calls' and its first `length` of this call), False
    at those a tool appended."""
    mask = torch.ones(len(row.earlier) + length, dtype=torch.bool)
    injected = [len(row.earlier) + i for i in row.injected if i < length]
    if injected:
        mask[injected] = False
    return mask
