"""Completion-length traces for the rollout benchmarks: the ragged lengths RL rollouts produce, imposed on a
random-weight policy (which never ends a row by itself) through the engine's logits processor.

Every speed figure before this module was a fixed-length rollout: every row ran to `max_new_tokens` at full batch. A
GRPO step's completions are ragged: most of a group's rows end early and a few run long, so most decode steps of a
rollout run at a handful of live rows. A trace is one length per row, drawn per GRPO group (the rows of one prompt,
`group_size` of them, consecutive as the trainer lays them out):

    length = min(cap, max(floor, round(median * exp(sigma_group * Z_g + sigma_row * Z_r))))

with Z_g ~ N(0, 1) once per group (the prompt's difficulty: hard prompts get long answers from every sample) and
Z_r ~ N(0, 1) per row (the spread between samples of one prompt); and with probability `runaway` per row the row
runs to the cap whatever its draw (a sample that loops or never closes its answer). A row at the cap is truncated:
it never samples EOS and the engine's length limit ends it (stop reason "length"); every other row samples EOS as its
last token (its length counts the EOS). Deterministic: group g of seed s draws from its own `random.Random` seeded
by (preset, s, g), so the first k groups of a larger draw are the k groups of a smaller one.

The presets and where their shape comes from (hand-set lognormals; the figures cited are what the papers report as
we recall them, not re-read here, and no completion was measured for them: an attempt to measure the embedded
SmolLM2-135M's GSM8K replies on this machine's CPU ran at ~7 tokens/s, too slow for 128 x 1,024 tokens, and a 135M
model's replies are not a 7B's):

* `gsm8k` (cap 1,024; median 250, sigma_group 0.35, sigma_row 0.45, runaway 1%): a 7B instruct model's
  chain-of-thought replies to GSM8K. Non-reasoning instruct models answer GSM8K in a few hundred tokens (the
  "conventional" models of Chen et al. 2024, "Do NOT Think That Much for 2+3=?", arXiv 2412.21187, at about 200-300
  tokens a GSM8K answer against the o1-like models' several times that; the GSM8K reference solutions themselves are
  ~100 tokens), with a thin tail of rambling or looping samples to the cap (the 1,024-token limit TRL-style GSM8K
  GRPO recipes use). Per 4,096 rows (seed 0): median ~250, mean ~300, p90 ~520, ~1.7% truncated. Stated bounds
  (tests/test_lengths.py): median 225-275, truncated 0.5-3.5%, p90 400-650.
* `long-cot` (cap 4,096; median 1,800, sigma_group 0.40, sigma_row 0.30, runaway 1%): long-CoT RL responses, as
  DeepSeek-R1-Zero-style / DAPO-style recipes produce on competition math: responses of a few thousand tokens that
  grow over training (DeepSeek-R1's Figure 3; DAPO, arXiv 2503.14476, whose length curve climbs through thousands of
  tokens; DeepScaleR's 8K stage, whose average response went from ~5,500 to ~3,500 tokens, incorrect answers about
  3x as long as correct ones), with a visible share cut at the cap (what DAPO's overlong filtering and soft overlong
  punishment exist for). Per 4,096 rows (seed 0): median ~1,800, ~7% truncated. Stated bounds: median 1,600-2,000,
  truncated 4-10%. At 128 rows that is ~8 rows running to the cap: the tail of a long-CoT rollout sits at about 8
  live rows, where speculation (`rollout.speculative_rows`: 8) only just engages.

A FILE trace (`--lengths FILE`): a JSON list of lengths, a JSON object {"lengths": [...], "cap": N}, or text of
integers separated by whitespace or commas; its cap is the object's "cap" or else its longest length (rows at the
cap are truncated). A trace of fewer rows than asked for repeats from its start.

Tools for the benchmarks:

* `trace(spec, rows, group_size, seed)`: a preset or a file as a `Trace` (lengths, cap, stats; `scaled(cap)` keeps
  the shape at another cap, for CPU dry runs).
* `forced_eos(lengths_per_row, eos_id, vocab, cap=None)`: the engine's `logits_processor` that forbids EOS before a
  row's length and forces it at length - 1, so the engine's own EOS bookkeeping, compaction and buckets end the rows.
* `oracle_policy(...)` / `OracleDrafts`: a synthetic policy and draft source for speculative decoding on random
  weights, right with a set probability: at every position the policy puts probability A on an oracle token
  o(row, position) (a fixed hash) and its own random-weight distribution on the rest; the drafts propose the oracle
  tokens ahead, so the rejection rule accepts each with probability A.
* `live_rows_profile(lengths, timeline)`: the share of decode steps (exact, from the lengths) and of wall time (from
  an engine timeline) spent below 8 live rows.

    python benchmarks/lengths.py gsm8k --rows 128        # a trace's statistics and live-row profile
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import re
import statistics
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

__all__ = ["Preset", "PRESETS", "Trace", "draw", "trace", "forced_eos", "oracle_policy", "oracle_token",
           "oracle_tokens", "OracleDrafts", "live_rows", "step_share_below", "token_share_below",
           "timeline_share_below", "live_rows_profile"]


@dataclass(frozen=True)
class Preset:
    """A lognormal length distribution drawn per group (the module docstring gives the formula and the sources)."""

    name: str
    median: float
    sigma_group: float
    sigma_row: float
    cap: int
    runaway: float  # per row: runs to the cap whatever its draw
    floor: int = 16


PRESETS = {
    "gsm8k": Preset("gsm8k", median=250, sigma_group=0.35, sigma_row=0.45, cap=1024, runaway=0.01),
    "long-cot": Preset("long-cot", median=1800, sigma_group=0.40, sigma_row=0.30, cap=4096, runaway=0.01),
}


def draw(preset: Preset, rows: int, group_size: int = 8, seed: int = 0) -> list[int]:
    """`rows` lengths of `preset`, group by group (rows i * group_size ... belong to group i; a last partial group
    is the first rows of a whole one)."""
    if rows < 1 or group_size < 1:
        raise ValueError(f"rows and group_size must be >= 1, got {rows}, {group_size}")
    out: list[int] = []
    salt = zlib.crc32(preset.name.encode())
    for g in range(-(-rows // group_size)):
        rng = random.Random((salt << 40) ^ (seed << 20) ^ g)
        difficulty = rng.gauss(0.0, 1.0)
        for _ in range(group_size):
            spread, runaway = rng.gauss(0.0, 1.0), rng.random() < preset.runaway
            value = preset.median * math.exp(preset.sigma_group * difficulty + preset.sigma_row * spread)
            out.append(preset.cap if runaway else min(preset.cap, max(preset.floor, round(value))))
    return out[:rows]


@dataclass(frozen=True)
class Trace:
    """One length per row (the completion's tokens, EOS included) and the cap (max_new_tokens); a row at the cap is
    truncated (no EOS)."""

    name: str
    lengths: tuple[int, ...]
    cap: int
    group_size: int = 8

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 1 or max(self.lengths) > self.cap:
            raise ValueError(f"trace {self.name}: lengths must be in [1, cap={self.cap}]")

    def scaled(self, cap: int) -> "Trace":
        """The same shape at another cap (CPU dry runs): each length times cap / self.cap, truncated rows kept
        truncated and the others kept below the cap."""
        if cap == self.cap:
            return self
        f = cap / self.cap
        lengths = tuple(cap if n >= self.cap else min(cap - 1, max(1, round(n * f))) for n in self.lengths)
        return Trace(f"{self.name}@{cap}", lengths, cap, self.group_size)

    def stats(self) -> dict[str, Any]:
        """What the trace is: its size and shape, and its exact live-row profile."""
        n = sorted(self.lengths)
        return {"trace": self.name, "rows": len(n), "cap": self.cap, "group_size": self.group_size,
                "tokens": sum(n), "median": statistics.median(n), "mean": sum(n) / len(n),
                "p90": n[min(len(n) - 1, int(0.9 * len(n)))], "longest": n[-1],
                "truncated_share": sum(x >= self.cap for x in n) / len(n),
                "decode_steps": n[-1], "decode_step_share_below8": step_share_below(n, 8),
                "token_share_below8": token_share_below(n, 8)}


def _read_file(path: Path) -> tuple[list[int], int | None]:
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [int(x) for x in re.split(r"[\s,]+", text.strip()) if x]
    cap = None
    if isinstance(data, dict):
        cap, data = data.get("cap"), data["lengths"]
    if not isinstance(data, list) or not data or not all(isinstance(x, int) and x >= 1 for x in data):
        raise ValueError(f"{path}: expected a list of positive integer lengths")
    return data, cap


def trace(spec: str, rows: int, group_size: int = 8, seed: int = 0) -> Trace:
    """`spec`: a preset's name or a file of lengths (module docstring); `rows` of them."""
    if spec in PRESETS:
        p = PRESETS[spec]
        return Trace(spec, tuple(draw(p, rows, group_size, seed)), p.cap, group_size)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--lengths {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a file")
    lengths, cap = _read_file(path)
    cap = cap or max(lengths)
    return Trace(path.name, tuple(lengths[i % len(lengths)] for i in range(rows)), cap, group_size)


# ------------------------------------------------------------------------------------------------ logits processors

def _eos_list(eos_id: int | Sequence[int]) -> list[int]:
    ids = [int(eos_id)] if isinstance(eos_id, int) else [int(i) for i in eos_id]
    if not ids:
        raise ValueError("forced_eos needs at least one EOS id")
    return ids


class _Lengths:
    """Each row's length as a device tensor (made once per device), padding rows (index >= rows) never ending."""

    def __init__(self, lengths: Sequence[int], cap: int | None):
        never = 2**40
        self.rows = len(lengths)
        self.host = [never if cap is not None and n >= cap else int(n) for n in lengths] + [never]
        self.tables: dict[torch.device, Tensor] = {}

    def __call__(self, rows: Tensor) -> Tensor:
        table = self.tables.get(rows.device)
        if table is None:
            table = self.tables[rows.device] = torch.tensor(self.host, dtype=torch.long, device=rows.device)
        return table[rows.clamp(0, self.rows)]


def _force(logits: Tensor, lengths: Tensor, positions: Tensor, eos: list[int]) -> None:
    """EOS forbidden before a row's length - 1, the only token at length - 1; rows past their end left alone."""
    before, at = positions < lengths - 1, positions == lengths - 1
    cols = logits[:, eos]
    cols.masked_fill_((before | at)[:, None], float("-inf"))
    logits.masked_fill_(at[:, None], float("-inf"))
    cols[:, 0].masked_fill_(at, 0.0)
    logits[:, eos] = cols


def forced_eos(lengths_per_row: Sequence[int], eos_id: int | Sequence[int], vocab: int,
               cap: int | None = None) -> Callable[[Tensor, Tensor, Tensor], None]:
    """A `RolloutEngine.generate` logits_processor ending row r exactly at `lengths_per_row[r]` tokens: every EOS id
    forbidden before position length - 1, the first EOS id the only token at it. With `cap` (the call's
    max_new_tokens) a row of length >= cap is truncated instead: EOS stays forbidden and the length limit ends it.
    Padding rows (row index >= the number of lengths) never see EOS. No host sync: the lengths live on the device."""
    eos = _eos_list(eos_id)
    if any(not 0 <= e < vocab for e in eos):
        raise ValueError(f"EOS ids {eos} outside the vocabulary of {vocab}")
    table = _Lengths(lengths_per_row, cap)

    def process(logits: Tensor, rows: Tensor, positions: Tensor) -> None:
        _force(logits, table(rows), positions, eos)

    return process


_P = 2**31 - 1  # a Lehmer generator's modulus: every product below stays within int64


def _oracle_hash(row, position):
    x = (row * 1_000_003 + position * 7_919 + 12_345) % _P
    x = x * 48_271 % _P
    return x * 48_271 % _P


def oracle_token(row: int, position: int, vocab: int, eos: int | Sequence[int]) -> int:
    """The oracle token of (row, completion position): a fixed hash into the vocabulary, never an EOS id."""
    eos = _eos_list(eos)
    t = _oracle_hash(row, position) % vocab
    return min(set(range(len(eos) + 1)) - set(eos)) if t in eos else t


def oracle_tokens(rows: Tensor, positions: Tensor, vocab: int, eos: int | Sequence[int]) -> Tensor:
    """`oracle_token` of each (row, position), on their device."""
    eos = _eos_list(eos)
    t = _oracle_hash(rows.long(), positions.long()) % vocab
    fallback = min(set(range(len(eos) + 1)) - set(eos))
    return torch.where(torch.isin(t, torch.tensor(eos, device=t.device)), fallback, t)


def oracle_policy(lengths_per_row: Sequence[int], eos_id: int | Sequence[int], vocab: int, acceptance: float,
                  cap: int | None = None, temperature: float = 1.0) -> Callable[[Tensor, Tensor, Tensor], None]:
    """`forced_eos`, and at every position before a row's end the oracle token's logit set so that it holds
    probability `acceptance` of the tempered distribution (the rest keeps the policy's own, renormalised): a
    policy that an `OracleDrafts` source predicts right with probability `acceptance` per token. The processor's
    `nonfinite()` counts the draws before a row's end whose logits had no finite value besides the oracle's (NaN or
    all -inf logits from the model: then the oracle's probability is not `acceptance`); counted on the device, no
    sync until asked."""
    if not 0.0 < acceptance < 1.0 or temperature <= 0:
        raise ValueError(f"acceptance must be in (0, 1) and temperature > 0, got {acceptance}, {temperature}")
    eos = _eos_list(eos_id)
    table = _Lengths(lengths_per_row, cap)
    odds = math.log(acceptance / (1.0 - acceptance))
    bad: dict[torch.device, Tensor] = {}

    def process(logits: Tensor, rows: Tensor, positions: Tensor) -> None:
        lengths = table(rows)
        _force(logits, lengths, positions, eos)
        o = oracle_tokens(rows, positions, vocab, eos)[:, None]
        logits.scatter_(1, o, float("-inf"))
        rest = torch.logsumexp(logits if temperature == 1.0 else logits / temperature, dim=1)
        value = temperature * (odds + rest)
        active = positions < lengths - 1
        if logits.device not in bad:
            bad[logits.device] = torch.zeros((), dtype=torch.long, device=logits.device)
        bad[logits.device] += (active & ~torch.isfinite(rest)).sum()
        logits.scatter_(1, o, torch.where(active, value, float("-inf"))[:, None])

    process.nonfinite = lambda: sum(int(t) for t in bad.values())
    return process


class OracleDrafts:
    """A draft source (`propose(row, k)`, `extend(row, tokens)`) proposing each row's oracle tokens from its next
    position on; one per generate call (it counts each row's tokens).

    It also measures what the policy did where it had drafted (`observed_acceptance`): of the tokens a verify step
    emits at positions it had proposed a draft for, the share that are the oracle's. An accepted draft is one; the
    token drawn at a rejection never is (the residual excludes the draft); a token drawn after every draft the
    engine used was accepted (it may use fewer than proposed) is the oracle's with the policy's probability, A. So
    the share estimates A (less for drafts that meet a row's forced EOS), whatever the engine cut."""

    def __init__(self, vocab: int, eos: int | Sequence[int]):
        self.vocab, self.eos, self.count = vocab, _eos_list(eos), {}
        self.pending: dict[int, list[int]] = {}  # row -> its last draft, until the step's extend
        self.proposed = self.hits = self.seen = 0

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        self.count[row] = self.count.get(row, 0) + len(tokens)
        draft = self.pending.pop(row, None)
        if draft is not None:  # a verify step's tokens: its accepted drafts, then one drawn token
            for t, d in zip(tokens, draft):
                self.seen += 1
                self.hits += t == d

    def propose(self, row: int, k: int) -> list[int]:
        at = self.count.get(row, 0)
        draft = [oracle_token(row, at + j, self.vocab, self.eos) for j in range(k)]
        self.pending[row] = draft
        self.proposed += k
        return draft

    def observed_acceptance(self) -> float | None:
        """The share of oracle tokens among those emitted where a draft was proposed; None when nothing was."""
        return self.hits / self.seen if self.seen else None


# ------------------------------------------------------------------------------------------------ live-row profiles

def live_rows(lengths: Sequence[int]) -> list[int]:
    """Rows live at each decode step s (those with length > s), s = 0 .. longest - 1."""
    n = sorted(lengths)
    return [len(n) - bisect.bisect_right(n, s) for s in range(n[-1])] if n else []


def step_share_below(lengths: Sequence[int], below: int = 8) -> float:
    """The share of a rollout's decode steps at fewer than `below` live rows (exact: one step per token of the longest
    row, as a loop that ends rows the moment they end would run)."""
    live = live_rows(lengths)
    return sum(x < below for x in live) / len(live) if live else 0.0


def token_share_below(lengths: Sequence[int], below: int = 8) -> float:
    """The share of the completions' tokens generated at fewer than `below` live rows."""
    live = live_rows(lengths)
    return sum(x for x in live if x < below) / max(1, sum(live))


def timeline_share_below(timeline: Sequence[tuple[int, Any]], below: int = 8) -> dict[str, float]:
    """From an engine timeline [(live rows from then on, when)] (when: CUDA events, synchronized here, or
    time.perf_counter() values): the seconds it spans (decode only: the first point is after the prefill) and the
    share of them spent at 1 to `below` - 1 live rows."""
    if len(timeline) < 2:
        return {"timeline_s": 0.0, "wall_share_below8": 0.0, "timeline_points": len(timeline)}
    whens = [w for _, w in timeline]
    if isinstance(whens[0], torch.cuda.Event):
        torch.cuda.synchronize()
        gaps = [a.elapsed_time(b) / 1000 for a, b in zip(whens, whens[1:])]
    else:
        gaps = [b - a for a, b in zip(whens, whens[1:])]
    total = sum(gaps)
    low = sum(g for (live, _), g in zip(timeline, gaps) if 0 < live < below)
    return {"timeline_s": total, "wall_share_below8": low / total if total > 0 else 0.0,
            "timeline_points": len(timeline)}


def live_rows_profile(lengths: Sequence[int], timeline: Sequence[tuple[int, Any]] | None = None,
                      below: int = 8) -> dict[str, float]:
    """The shares of a rollout below `below` live rows: of its decode steps and tokens (exact, from the lengths) and,
    given the engine's timeline of the call, of its decode wall time."""
    out = {"decode_step_share_below8": step_share_below(lengths, below),
           "token_share_below8": token_share_below(lengths, below)}
    if timeline is not None:
        out.update(timeline_share_below(timeline, below))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lengths", help=f"a preset ({', '.join(PRESETS)}) or a file of lengths")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", help="write the trace's lengths here as a JSON object (a FILE trace)")
    args = ap.parse_args()
    t = trace(args.lengths, args.rows, args.group, args.seed)
    print(json.dumps(t.stats(), indent=1))
    if args.write:
        Path(args.write).write_text(json.dumps({"lengths": list(t.lengths), "cap": t.cap}))


if __name__ == "__main__":
    main()
