"""Data-parallel training over real processes (gloo on 127.0.0.1): 2 ranks on a step of 2 x P prompts give the
metrics.jsonl and adapter of 1 process on the same prompts, resume included, and a dead rank fails the job in a line."""

import json
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from qerl.rl.distributed import DistributedError, Group
from tests.patience import patience
from tests.test_trainer import adapter_tensors, make_trainer, tiny_settings

# Wall-clock and memory readings differ between runs by nature; everything else must match.
TIMINGS = {"seconds_rollout", "seconds_scoring", "seconds_update", "rollout_tokens_per_s", "peak_memory_gb"}


def settings_2xP(tmp_path, **sections):
    """P = 2 prompts per rank, 4 samples each, micro-batches that straddle groups, AQN noisy from step 2."""
    train = {"steps": 4, "save_every": 2, **sections.pop("train", {})}
    return tiny_settings(tmp_path, rollout={"prompts_per_step": 4, "group_size": 4}, train=train, **sections)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, tmp_path, out, max_steps, resume, die_at_update, sections):
    torch.set_num_threads(1)  # two ranks share the CI's cores
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=timedelta(seconds=60))
    try:
        trainer = make_trainer(settings_2xP(tmp_path, **sections), out, resume=resume)
        if die_at_update and rank == 1:
            trainer.update = lambda batch: os._exit(3)  # a rank killed mid-step, as by the OOM killer
        trainer.train(max_steps=max_steps)
    except Exception as exc:  # what the rank's `qerl train` would print
        (tmp_path / f"error-rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    """The ranks are forked from one server process that imported this module (torch, qerl, the tests' trainer) once,
    instead of each paying an interpreter's start-up and those imports (~4 s of CPU each, 8 ranks in this file); the
    server has run nothing (no threads, no gloo), so a fork of it is as clean as a spawn. Stopped after the module."""
    from multiprocessing import forkserver as server

    server.set_forkserver_preload([__name__])
    yield
    server._forkserver._stop()  # CPython's own tests stop it so; without it the session's sweep would name it


def run_ranks(tmp_path, out, world=2, max_steps=None, resume=False, die_at_update=False, timeout=patience(240),
              **sections):
    ctx = mp.get_context("forkserver")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, tmp_path, out, max_steps, resume, die_at_update,
                                                 sections)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a rank hung"
    return [p.exitcode for p in procs]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_and_resume_to_the_one_process_run(tmp_path):
    one = make_trainer(settings_2xP(tmp_path), tmp_path / "one")
    one.train()

    # The 2-rank run in two legs: steps 1-2, then --resume from its step-2 checkpoint to step 4.
    assert run_ranks(tmp_path, tmp_path / "two", max_steps=2) == [0, 0]
    assert run_ranks(tmp_path, tmp_path / "two", resume=True) == [0, 0]

    expected, got = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert expected[-1]["sigma"] > 0  # AQN noise is on in the compared steps
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        for k in e.keys() - TIMINGS:
            assert g[k] == pytest.approx(e[k], rel=1e-4, abs=1e-5), (e["step"], k)
    ta, tb = adapter_tensors(tmp_path / "one"), adapter_tensors(tmp_path / "two")
    assert ta.keys() == tb.keys()
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-4, atol=1e-5)
    # rank 0 alone wrote the run: no second writer's files
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step-000002", "step-000004"]


def test_dynamic_sampling_over_two_ranks_equals_one_process(tmp_path):
    """DAPO's resampling rounds decided on the whole step and the kept groups re-sharded: the one-process run's
    metrics (rounds, kept groups, rewards, loss) and adapter."""
    sections = {"grpo": {"dynamic_sampling": True, "max_resample_rounds": 3},
                "train": {"steps": 2, "save_every": 2, "rewards": {"tests.test_distributed:coin_reward": 1.0}}}
    one = make_trainer(settings_2xP(tmp_path, **sections), tmp_path / "one")
    one.train()
    assert run_ranks(tmp_path, tmp_path / "two", **sections) == [0, 0]
    expected, got = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in got] == [1, 2]
    assert max(m["dynamic_sampling/rounds"] for m in expected) > 1  # groups were dropped and more drawn
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        for k in e.keys() - TIMINGS:
            assert g[k] == pytest.approx(e[k], rel=1e-4, abs=1e-5), (e["step"], k)
    ta, tb = adapter_tensors(tmp_path / "one"), adapter_tensors(tmp_path / "two")
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-4, atol=1e-5)


def test_top_entropy_mask_over_two_ranks_takes_the_whole_steps_quantile(tmp_path):
    """grpo.top_entropy_quantile: the threshold is the quantile of every rank's loss tokens (each rank's own would
    keep other tokens), with GSPO's sequence ratios and sequence-level MIS: the one-process run's metrics and
    adapter."""
    sections = {"grpo": {"top_entropy_quantile": 0.4, "loss_type": "cispo", "importance_sampling_level": "sequence",
                         "correction": "mis", "correction_level": "sequence"},
                "train": {"steps": 1, "save_every": 1},
                # Adam's first step is ~lr * sign(g) down to |g| ~ eps: with most tokens masked a few LoRA elements'
                # gradients are ~2e-8 (cancellation residues), whose step the two processes' rounding would move
                "optim": {"eps": 1e-6}}
    one = make_trainer(settings_2xP(tmp_path, **sections), tmp_path / "one")
    one.train()
    assert run_ranks(tmp_path, tmp_path / "two", **sections) == [0, 0]
    (expected,), (got,) = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert expected.keys() == got.keys() and "entropy_mask/kept" in got
    # (the plain grader's score of the step misses its deadline now and then on a loaded machine: not the update's)
    for k in expected.keys() - TIMINGS - {"accuracy", "grader_timeouts"}:
        assert got[k] == pytest.approx(expected[k], rel=1e-4, abs=1e-5), k
    ta, tb = adapter_tensors(tmp_path / "one"), adapter_tensors(tmp_path / "two")
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-4, atol=1e-5)


def coin_reward(completion: str, gold: str) -> float:
    """1 for completions of odd length: some groups all-equal (dropped), others mixed (kept)."""
    return float(len(completion) % 2)


def test_a_dead_rank_fails_rank_0_with_a_clear_error_not_a_hang(tmp_path):
    codes = run_ranks(tmp_path, tmp_path / "run", die_at_update=True, timeout=patience(120))
    assert codes[1] == 3 and codes[0] != 0
    message = (tmp_path / "error-rank0.txt").read_text()
    assert "rank 0" in message and "another rank died or timed out" in message


def reward_failing_on_rank_1(completion: str, gold: str) -> float:
    if torch.distributed.get_rank() == 1:
        raise ValueError("rank 1's reward broke")
    return 1.0


def test_a_reward_failing_on_one_rank_fails_every_rank_with_its_message(tmp_path):
    """Rank 0 scored its share fine and would wait in the update's all-reduce for a rank that has left the step: it
    fails too, with the reward's own line (not a lost peer's), and the run folder keeps no half-done step."""
    sections = {"train": {"rewards": {"tests.test_distributed:reward_failing_on_rank_1": 1.0}}}
    codes = run_ranks(tmp_path, tmp_path / "run", timeout=patience(60), **sections)
    assert codes[0] != 0 and codes[1] != 0
    for rank in (0, 1):
        message = (tmp_path / f"error-rank{rank}.txt").read_text()
        assert message.startswith("RewardFailed: ") and "rank 1's reward broke" in message, (rank, message)
        assert "reward_failing_on_rank_1" in message and "no checkpoint yet" in message, (rank, message)
    assert "rank 1" in (tmp_path / "error-rank0.txt").read_text()
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not metrics(tmp_path / "run")


def test_prompts_that_do_not_split_over_the_ranks_are_refused_in_a_line():
    with pytest.raises(ValueError, match="multiple of the process count"):
        Group(rank=0, world_size=2).shard(range(3))
    assert Group(rank=1, world_size=2).shard(list("abcd")) == (2, ["c", "d"])
