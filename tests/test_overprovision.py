"""Over-provisioned rollouts (rollout.overprovision, APRIL): the engine stops once enough whole groups are finished
and returns those groups' rows exactly as an uncut call samples them; the trainer draws the extra prompts, trains on
`prompts_per_step` groups, composes with dynamic sampling and resumes bit for bit.

CPU: tiny models as tests/rollout/test_engine.py and tests/test_trainer.py build them.
"""
import copy
import json
import math

import pytest
import torch

from qerl.config import ConfigError, settings_from_dict
from qerl.rl import distributed, grpo
from qerl.rollout.backends import Sampling
from qerl.rollout.engine import RolloutEngine
from tests.rollout.test_engine import assert_same, prompts, tiny
from tests.test_trainer import adapter_tensors, make_trainer, tiny_settings

G = 3  # rows per group in the engine tests
MAX_NEW = 40
EOS = list(range(10, 22))  # 12 of 97 tokens: rows end after ~8 tokens, groups at very different steps


def group_rows(n_prompts: int, seed: int = 3):
    ps = prompts(n_prompts, seed=seed)
    rows = [p for p in ps for _ in range(G)]
    return rows, list(range(100, 100 + len(rows))), [i // G for i in range(len(rows))]


def finish_check(length: int, check_every: int) -> float:
    """The host check (counted in steps) at which a row of `length` tokens is seen finished: the first check step
    at or after its last token, or the call's end (no check at its last step) for the rows that reach it."""
    at = math.ceil(length / check_every) * check_every
    return at if at < MAX_NEW else math.inf


def expected_kept(uncut, needed: int, check_every: int) -> list[int]:
    groups = len(uncut.completion_ids) // G
    done = [max(finish_check(len(c), check_every) for c in uncut.completion_ids[g * G:(g + 1) * G])
            for g in range(groups)]
    return sorted(sorted(range(groups), key=lambda g: (done[g], g))[:needed])


ENGINES = {
    "reference": (lambda m: RolloutEngine.reference(m), 1),
    "engine": (lambda m: RolloutEngine(m, check_every=4, window=8), 4),  # buckets, compaction, checks every 4
    # every row speculative from the first step: the whole call is the speculative tail, which must stop too
    "speculative": (lambda m: RolloutEngine(m, check_every=4, window=8, speculative="on", speculative_rows=64), None),
}


@pytest.mark.parametrize("kind", list(ENGINES))
def test_the_engine_stops_once_enough_groups_finish_and_keeps_their_rows_unchanged(kind):
    make, check_every = ENGINES[kind]
    model = tiny()
    rows, seeds, groups = group_rows(6)
    needed = 3
    engine = make(model)
    uncut = engine.generate(None, rows, MAX_NEW, temperature=1.0, row_seeds=seeds, eos_token_ids=EOS)
    assert "cut" not in uncut.stop_reasons
    out = engine.generate(None, rows, MAX_NEW, temperature=1.0, row_seeds=seeds, eos_token_ids=EOS, groups=groups,
                          groups_needed=needed)
    if kind == "speculative":
        assert engine.stats["verify_steps"] > 0
    cut_groups = {g for g, r in zip(groups, out.stop_reasons) if r == "cut"}
    kept = [g for g in range(len(rows) // G) if g not in cut_groups]
    assert len(kept) == needed
    assert all(set(out.stop_reasons[g * G:(g + 1) * G]) == {"cut"} for g in cut_groups)  # groups are whole
    if check_every is not None:  # the first groups to finish, the lowest index among those finished at one check
        assert kept == expected_kept(uncut, needed, check_every)
        assert kept != list(range(needed))  # (a test of the order, not of the first groups)
    keep_rows = [i for i, g in enumerate(groups) if g in kept]
    assert_same(out.select(keep_rows), uncut.select(keep_rows), atol=0)  # a row's draws are its own
    shorter = 0
    for i, g in enumerate(groups):
        if g in cut_groups:  # its tokens so far: a prefix of what the uncut call drew
            ids, full = out.completion_ids[i], uncut.completion_ids[i]
            assert ids == full[:len(ids)] and torch.equal(out.logprobs[i], uncut.logprobs[i][:len(ids)])
            shorter += len(ids) < len(full)
    assert shorter > 0  # the cut saved steps


def test_groups_need_not_be_consecutive_and_all_groups_needed_is_the_uncut_call():
    model = tiny()
    rows, seeds, _ = group_rows(5, seed=4)
    engine = RolloutEngine(model, check_every=4, window=8)
    uncut = engine.generate(None, rows, MAX_NEW, temperature=1.0, row_seeds=seeds, eos_token_ids=EOS)
    every = engine.generate(None, rows, MAX_NEW, temperature=1.0, row_seeds=seeds, eos_token_ids=EOS,
                            groups=[i // G for i in range(len(rows))], groups_needed=len(rows) // G)
    assert_same(every, uncut, atol=0)
    interleaved = [i % 5 for i in range(len(rows))]  # group g: rows g, g + 5, g + 10
    out = engine.generate(None, rows, MAX_NEW, temperature=1.0, row_seeds=seeds, eos_token_ids=EOS,
                          groups=interleaved, groups_needed=2)
    cut = {g for g, r in zip(interleaved, out.stop_reasons) if r == "cut"}
    assert len(cut) == 3 and all((r == "cut") == (g in cut) for g, r in zip(interleaved, out.stop_reasons))
    done = [max(finish_check(len(uncut.completion_ids[i]), 4) for i in range(g, len(rows), 5)) for g in range(5)]
    assert sorted(set(range(5)) - cut) == sorted(sorted(range(5), key=lambda g: (done[g], g))[:2])


def test_groups_and_groups_needed_are_checked():
    model, rows = tiny(), group_rows(2)[0]
    engine = RolloutEngine.reference(model)
    for bad in ({"groups": [0] * len(rows)}, {"groups_needed": 1}, {"groups": [0, 1], "groups_needed": 1},
                {"groups": [i // G for i in range(len(rows))], "groups_needed": 3},
                {"groups": [i // G for i in range(len(rows))], "groups_needed": 0}):
        with pytest.raises(ValueError):
            engine.generate(None, rows, 4, temperature=1.0, seed=0, **bad)


def test_sampling_derives_the_groups_from_row_order():
    s = Sampling(max_new_tokens=4, groups_needed=2, group_size=3)
    assert s.kwargs(9)["groups"] == [0, 0, 0, 1, 1, 1, 2, 2, 2] and s.kwargs(9)["groups_needed"] == 2
    assert "groups" not in Sampling(max_new_tokens=4).kwargs(9) and "group_size" not in s.kwargs(9)


# ---------------------------------------------------------------------------------------------------- trainer

# Stop strings end rows after ~5 tokens at very different lengths (the tiny policy is near-uniform over 29 chars)
OVER = {"overprovision": 1.0, "max_new_tokens": 16, "stop_strings": ["1", "2", "3", "4", "5"]}


def test_the_settings_compute_the_draw_and_refuse_what_cannot_stop():
    assert tiny_settings(None, rollout={"prompts_per_step": 10, "overprovision": 0.1}).rollout.prompts_drawn == 11
    assert tiny_settings(None, rollout={"prompts_per_step": 8, "overprovision": 0.3}).rollout.prompts_drawn == 11
    assert tiny_settings(None).rollout.prompts_drawn == 2
    with pytest.raises(ConfigError, match="overprovision"):
        settings_from_dict({"rollout": {"backend": "vllm", "overprovision": 0.5}})
    with pytest.raises(ConfigError, match="overprovision"):
        settings_from_dict({"rollout": {"overprovision": -0.5}})


def test_overprovision_is_refused_over_several_processes_and_beyond_the_data(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="more than the 3 training prompts"):
        make_trainer(tiny_settings(None, rollout=OVER, data={"n": 3}), tmp_path / "small")
    monkeypatch.setattr(distributed, "current", lambda: distributed.Group(0, 2))
    with pytest.raises(ValueError, match="not over 2 processes"):
        make_trainer(tiny_settings(None, rollout=OVER), tmp_path / "ranks")


def test_the_trainer_trains_on_the_groups_that_finished_first(tmp_path):
    with make_trainer(tiny_settings(None, rollout=OVER), tmp_path / "run") as trainer:
        sampler = copy.deepcopy(trainer.sampler)
        drawn = sampler.next_batch()
        assert len(drawn) == 4 and trainer.sampler.position == 0
        batch = trainer.score(trainer.rollout())
        assert trainer.sampler.state_dict() == sampler.state_dict()  # the 4 drawn prompts, kept or not, consumed
        uncut = trainer.rollout(drawn)  # the same prompts at the same step: the same row seeds, no cut
        assert "cut" not in uncut.samples.stop_reasons
        want = expected_kept_groups(uncut.samples, 4, 4, 16)
        assert want != [0, 1]  # (the order matters here, not only the first groups)
        assert batch.examples == [drawn[g] for g in want] and len(batch) == 2 * 4
        rows = [g * 4 + j for g in want for j in range(4)]
        assert_same(batch.samples, uncut.samples.select(rows), atol=0)
        dropped = [i for i in range(16) if i not in rows]
        assert batch.extra["rollout/groups_dropped"] == 2
        assert 0 < batch.extra["rollout/tokens_dropped"] < sum(len(uncut.samples.completion_ids[i]) for i in dropped)
        metrics = trainer.update(batch)
        assert metrics["rollout/groups_dropped"] == 2


def expected_kept_groups(samples, groups: int, group_size: int, max_new: int, needed: int = 2) -> list[int]:
    """The reference backend checks every step: a group is done at its longest row (a row at the limit: the end)."""
    done = [max(len(c) if len(c) < max_new else math.inf
                for c in samples.completion_ids[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    return sorted(sorted(range(groups), key=lambda g: (done[g], g))[:needed])


def test_overprovision_zero_changes_nothing(tmp_path, monkeypatch):
    """Off (the default, or 0 written out): the sampler draws prompts_per_step, the rollout is not told to stop,
    and no rollout/ metric appears."""
    settings = tiny_settings(None, rollout={**OVER, "overprovision": 0.0})
    with make_trainer(settings, tmp_path / "run") as trainer:
        seen = []
        generate = trainer.rollout_backend.generate
        monkeypatch.setattr(trainer.rollout_backend, "generate",
                            lambda prompts, sampling, **kw: seen.append(sampling) or generate(prompts, sampling, **kw))
        batch = trainer.score(trainer.rollout())
        assert len(batch.examples) == 2 and trainer.sampler.position == 2
        assert seen[0].groups_needed is None and "groups" not in seen[0].kwargs(len(batch))
        assert not any(k.startswith("rollout/") for k in batch.extra)


def test_overprovision_with_dynamic_sampling_keeps_informative_finished_groups(tmp_path):
    settings = tiny_settings(None, rollout=OVER, grpo={"dynamic_sampling": True, "max_resample_rounds": 2},
                             train={"rewards": {"tests.test_trainer:odd_gold_ones_reward": 1.0}})
    with make_trainer(settings, tmp_path / "run") as trainer:
        batch = trainer.keep_informative(trainer.score(trainer.rollout()))
        rounds = batch.extra["dynamic_sampling/rounds"]
        assert batch.extra["rollout/groups_dropped"] == 2 * rounds  # each round drew 4 prompts and kept 2
        assert trainer.sampler.position == 4 * rounds
        assert 1 <= len(batch.examples) <= 2 and "cut" not in batch.samples.stop_reasons
        assert grpo.informative_groups(batch.rewards, 4).all()


def test_a_resumed_run_with_overprovision_trains_what_the_uninterrupted_run_did(tmp_path):
    settings = tiny_settings(None, rollout=OVER)
    with make_trainer(settings, tmp_path / "whole") as trainer:
        trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/groups_dropped"] for r in rows] == [2, 2, 2, 2]
    with make_trainer(settings, tmp_path / "split") as trainer:
        trainer.train(max_steps=2)
    with make_trainer(settings, tmp_path / "split", resume=True) as trainer:
        assert trainer.sampler.position == 8  # two steps of 4 drawn prompts
        trainer.train()
    whole, split = adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "split")
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    split_rows = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/tokens_dropped"] for r in split_rows] == [r["rollout/tokens_dropped"] for r in rows]


def test_speculation_on_is_refused_with_the_vllm_backend():
    # vLLM's n-gram speculation with LoRA crashed on concurrent requests (vllm-project/vllm#20284): `on` must not be
    # silently ignored there; `auto` means the engine's speculation only and stays accepted
    with pytest.raises(ConfigError, match="speculative.*vllm"):
        settings_from_dict({"rollout": {"backend": "vllm", "speculative": "on"}})
    assert settings_from_dict({"rollout": {"backend": "vllm", "speculative": "auto"}}).rollout.speculative == "auto"
