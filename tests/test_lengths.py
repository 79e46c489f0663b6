"""benchmarks/lengths.py on the CPU: the length presets are deterministic and shaped as its docstring states, drawn per
GRPO group; forced_eos makes a tiny engine's rows end exactly at their lengths (plain, reference and speculative);
the oracle policy and drafts accept at the set rate; the live-row profiles on hand-made cases; and a dry run of
`bench_rollout.py --lengths` whose rows carry the new fields."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.rollout.engine import RolloutEngine
from tests.patience import patience
from tests.rollout.test_engine import prompts, tiny

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import lengths as L  # noqa: E402

VOCAB, EOS = 97, 96  # tiny()'s vocabulary; its last id as the end token


# ------------------------------------------------------------------------------------------------ presets

def test_presets_are_deterministic_and_prefix_stable():
    for name in L.PRESETS:
        a, b = L.trace(name, 128), L.trace(name, 128)
        assert a.lengths == b.lengths
        assert L.trace(name, 128, seed=1).lengths != a.lengths  # the seed matters
        assert L.trace(name, 48).lengths == a.lengths[:48]  # group g's draw does not depend on how many groups
        assert L.trace(name, 60).lengths == a.lengths[:60]  # a partial last group: the first rows of a whole one


@pytest.mark.parametrize("name,median,truncated,cap", [
    ("gsm8k", (225, 275), (0.005, 0.035), 1024),
    ("long-cot", (1600, 2000), (0.04, 0.10), 4096),
])
def test_presets_are_shaped_as_documented(name, median, truncated, cap):
    t = L.trace(name, 4096)
    s = t.stats()
    assert t.cap == cap and s["longest"] == cap and min(t.lengths) >= 1
    assert median[0] <= s["median"] <= median[1], s
    assert truncated[0] <= s["truncated_share"] <= truncated[1], s
    if name == "gsm8k":  # a few hundred tokens: the tail is thin
        assert 400 <= s["p90"] <= 650, s


@pytest.mark.parametrize("name", list(L.PRESETS))
def test_lengths_are_drawn_per_group(name):
    """The spread of log-lengths splits into a group part and a row part as the preset's sigmas say (untruncated rows):
    drawn per row, the group means would vary only by the row spread / sqrt(group)."""
    p, g = L.PRESETS[name], 8
    t = L.trace(name, 8 * 2048, group_size=g)
    groups = [t.lengths[i:i + g] for i in range(0, len(t.lengths), g)]
    groups = [[math.log(x) for x in grp] for grp in groups if max(grp) < p.cap and min(grp) > p.floor]
    within = statistics.mean(statistics.variance(grp) for grp in groups)
    between = statistics.variance([statistics.mean(grp) for grp in groups]) - within / g
    assert abs(math.sqrt(within) - p.sigma_row) < 0.25 * p.sigma_row, (within, p)
    assert abs(math.sqrt(max(between, 0)) - p.sigma_group) < 0.25 * p.sigma_group, (between, p)


def test_file_traces_and_scaling(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([5, 9, 20]))
    (tmp_path / "b.txt").write_text("5, 9\n20")
    (tmp_path / "c.json").write_text(json.dumps({"lengths": [5, 9], "cap": 32}))
    a, b, c = (L.trace(str(tmp_path / f), 4) for f in ("a.json", "b.txt", "c.json"))
    assert a.lengths == b.lengths == (5, 9, 20, 5) and a.cap == b.cap == 20  # repeated from the start; cap: longest
    assert c.lengths == (5, 9, 5, 9) and c.cap == 32
    s = L.trace("gsm8k", 64).scaled(64)
    assert s.cap == 64 and max(s.lengths) <= 64
    full = L.trace("gsm8k", 64)
    # truncated rows stay truncated, the others stay below the cap
    assert [x == 64 for x in s.lengths] == [x == full.cap for x in full.lengths]
    with pytest.raises(ValueError):
        L.trace("no-such-preset", 4)


# ------------------------------------------------------------------------------------------------ processors

CAP = 24
LENGTHS = [1, 5, 24, 13, 2]  # row 2 runs to the cap: truncated


def _ends(out, lengths=LENGTHS, cap=CAP):
    assert [len(c) for c in out.completion_ids] == list(lengths)
    assert out.stop_reasons == ["length" if n >= cap else "eos" for n in lengths]
    for c, n in zip(out.completion_ids, lengths):
        assert EOS not in c[:-1] and (c[-1] == EOS) == (n < cap)


@pytest.mark.parametrize("make", [
    lambda m: RolloutEngine(m, check_every=3, window=8),  # buckets with padding rows, compaction, windows
    lambda m: RolloutEngine.reference(m),
])
def test_forced_eos_ends_rows_at_their_lengths(make):
    model, ps = tiny(vocab=VOCAB), prompts(5)
    engine = make(model)
    free = engine.generate(None, ps, CAP, temperature=1.0, eos_token_ids=[EOS], seed=0)
    assert [len(c) for c in free.completion_ids] != LENGTHS  # without it the rows do not end there
    out = engine.generate(None, ps, CAP, temperature=1.0, eos_token_ids=[EOS], seed=0,
                          logits_processor=L.forced_eos(LENGTHS, EOS, VOCAB, cap=CAP))
    _ends(out)
    # without `cap`, a row at the cap samples EOS as its last token
    out = engine.generate(None, ps, CAP, temperature=1.0, eos_token_ids=[EOS], seed=0,
                          logits_processor=L.forced_eos(LENGTHS, EOS, VOCAB))
    assert [len(c) for c in out.completion_ids] == LENGTHS and out.stop_reasons == ["eos"] * 5


@pytest.mark.parametrize("acceptance", [0.5, 0.9])
def test_oracle_policy_and_drafts_accept_at_the_set_rate(acceptance):
    model, ps = tiny(vocab=VOCAB), prompts(8)
    lengths = [120, 100, 90, 80, 70, 60, 50, 40]
    policy = L.oracle_policy(lengths, EOS, VOCAB, acceptance, cap=128)
    plain = RolloutEngine(model).generate(None, ps, 128, temperature=1.0, eos_token_ids=[EOS], seed=0,
                                          logits_processor=policy)
    _ends(plain, lengths, 128)
    hits = [t == L.oracle_token(r, p, VOCAB, EOS) for r, c in enumerate(plain.completion_ids)
            for p, t in enumerate(c[:-1])]
    assert abs(sum(hits) / len(hits) - acceptance) < 0.06
    engine = RolloutEngine(model, speculative="on", speculative_rows=8)
    drafts = L.OracleDrafts(VOCAB, EOS)
    out = engine.generate(None, ps, 128, temperature=1.0, eos_token_ids=[EOS], seed=0, drafts=drafts,
                          logits_processor=policy)
    _ends(out, lengths, 128)
    assert engine.stats["verify_steps"] > 0 and engine.stats["accepted"] > 0
    assert abs(drafts.observed_acceptance() - acceptance) < 0.1, (drafts.hits, drafts.seen)
    assert drafts.proposed >= engine.stats["drafted"] > 0  # the engine may use fewer drafts than proposed
    assert policy.nonfinite() == 0


def test_oracle_policy_counts_draws_without_finite_logits():
    policy = L.oracle_policy([10, 10], EOS, VOCAB, 0.7)
    logits = torch.randn(2, VOCAB)
    logits[1] = float("nan")  # a model whose logits broke: the oracle's share cannot be A there
    policy(logits, torch.tensor([0, 1]), torch.tensor([3, 3]))
    assert policy.nonfinite() == 1
    p = logits[0].softmax(-1)
    assert p[L.oracle_token(0, 3, VOCAB, EOS)] == pytest.approx(0.7) and p[EOS] == 0
    policy(torch.randn(2, VOCAB), torch.tensor([0, 1]), torch.tensor([9, 9]))  # the forced EOS: not a draw of A
    assert policy.nonfinite() == 1


def test_oracle_token_matches_its_tensor_form_and_avoids_eos():
    rows, pos = torch.arange(50).repeat_interleave(40), torch.arange(40).repeat(50)
    t = L.oracle_tokens(rows, pos, VOCAB, EOS)
    assert t.tolist() == [L.oracle_token(r, p, VOCAB, EOS) for r, p in zip(rows.tolist(), pos.tolist())]
    assert EOS not in t.tolist() and len(set(t.tolist())) > 60


# ------------------------------------------------------------------------------------------------ profiles

def test_live_row_profiles_on_a_hand_made_case():
    lengths = [1, 2, 10]  # live rows per step: 3, 2, then 1 for 8 steps
    assert L.live_rows(lengths) == [3, 2] + [1] * 8
    assert L.step_share_below(lengths, 2) == pytest.approx(0.8)
    assert L.token_share_below(lengths, 2) == pytest.approx(8 / 13)
    assert L.step_share_below([16] * 8, 8) == 0.0  # 8 live rows is not below 8
    timeline = [(3, 0.0), (2, 1.0), (1, 3.0), (0, 7.0)]  # (live rows from then on, when)
    p = L.live_rows_profile(lengths, timeline, below=2)
    assert p["timeline_s"] == pytest.approx(7.0) and p["wall_share_below8"] == pytest.approx(4 / 7)
    assert p["decode_step_share_below8"] == pytest.approx(0.8)


def test_engine_timeline_feeds_the_wall_share():
    model, ps = tiny(vocab=VOCAB), prompts(5)
    engine = RolloutEngine(model, check_every=2, window=8)
    engine.timeline = []
    engine.generate(None, ps, CAP, temperature=1.0, eos_token_ids=[EOS], seed=0,
                    logits_processor=L.forced_eos(LENGTHS, EOS, VOCAB, cap=CAP))
    timeline = engine.timeline
    assert timeline[0][0] == 5 and timeline[-1][0] == 0 and len(timeline) > 3
    share = L.timeline_share_below(timeline, below=3)["wall_share_below8"]
    assert 0.0 < share < 1.0  # the tail at 1-2 rows (rows 2 and 3 run longest) is part of the rollout


# ------------------------------------------------------------------------------------------------ the dry run

def test_bench_rollout_dry_run_with_lengths(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_rollout.py"), "--device", "cpu", "--models", "tiny",
           "--schemes", "bf16,nvfp4", "--batches", "16", "--new", "256", "--prompt", "16", "--lengths", "gsm8k",
           "--speculative", "off,on", "--acceptance", "0.7", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=patience(60),
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    assert [(r["scheme"], r["speculative"]) for r in rows] == [("bf16", False), ("bf16", True), ("nvfp4", False),
                                                               ("nvfp4", True)]
    for r in rows:
        assert r["lengths_exact"] and r["trace"] == "gsm8k@256" and r["new"] == 256 and r["acceptance"] == 0.7
        assert r["tokens"] == sum(L.trace("gsm8k", 16).scaled(256).lengths)
        assert r["useful_tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert 0 < r["decode_step_share_below8"] < 1 and 0 <= r["wall_share_below8"] <= 1
        assert r["timeline_points"] >= 2
    spec = [r for r in rows if r["speculative"]]
    assert all(r["verify_steps"] > 0 and 0 < r["accepted"] <= r["drafted"] for r in spec)
    assert all(r["oracle_acceptance_observed"] is not None for r in spec)
    assert "NVFP4 vs bf16" in done.stdout and "vs plain" in done.stdout
