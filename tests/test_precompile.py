"""Precompiling a run's GPU kernels in worker processes (qerl.rl.precompile): what the workers are given, how they
split the kernels, the stamp that skips them, and that a worker runs its whole path (on the CPU here; on CUDA the
end-to-end check is tests/test_gpu_cli.py::test_gpu_train_on_a_fresh_machine_compiles_in_workers)."""

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.config import load_settings
from qerl.model.loading import embedded_model_path, read_config
from qerl.model.transformer import ModelConfig
from qerl.rl import precompile

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_hf(read_config(embedded_model_path()))


def test_jobs_cover_every_bucket_a_step_can_reach_and_differ_only_in_their_share(config):
    s = load_settings(overrides=["rollout.prompts_per_step=8", "rollout.group_size=8"])
    jobs = precompile.jobs(s, config, 40, torch.device("cuda"), 3)
    assert [j["share"] for j in jobs] == [0, 1, 2] and {j["shares"] for j in jobs} == {3}
    assert jobs[0]["buckets"] == [64, 32, 16, 8]  # 64 rows, halved as they finish, down to the smallest bucket
    strip = [{k: v for k, v in j.items() if k != "share"} for j in jobs]
    assert strip[0] == strip[1] == strip[2]
    small = precompile.jobs(load_settings(overrides=["rollout.prompts_per_step=2", "rollout.group_size=2"]),
                            config, 40, torch.device("cuda"), 1)
    assert small[0]["buckets"] == [8]


def test_the_stamp_names_shapes_and_settings_not_the_share(config, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(precompile, "_triton_cache_dir", lambda: tmp_path / "triton")
    s = load_settings()
    a, b = precompile.jobs(s, config, 40, torch.device("cuda"), 2)
    assert precompile.stamp_path(a) == precompile.stamp_path(b)
    assert precompile.stamp_path(a).parent == tmp_path / "triton" / "qerl-precompiled"
    longer = precompile.jobs(s, config, 48, torch.device("cuda"), 2)[0]
    fp8 = precompile.jobs(load_settings(overrides=["model.base_gemm=fp8"]), config, 40, torch.device("cuda"), 2)[0]
    assert len({precompile.stamp_path(j) for j in (a, longer, fp8)}) == 3


def test_the_stamp_hashes_the_sources_of_qerl_and_of_its_kernels():
    """kernels/ is a namespace portion (no `__init__.py`, so no file to find it by): its sources still count, and
    nothing else of the checkout does (qerl's search path holds the checkout's root)."""
    files = precompile.source_files()
    assert {REPO / "qerl" / "rl" / "precompile.py", REPO / "kernels" / "gemm.py"} <= set(files)
    outside = [f for f in files if not (f.is_relative_to(REPO / "qerl") or f.is_relative_to(REPO / "kernels"))]
    assert not outside, outside[:5]


def test_nothing_starts_off_cuda_or_when_turned_off(config):
    assert precompile.start(load_settings(), config, 40, torch.device("cpu"), loaded=True) is None
    off = load_settings(overrides=["model.precompile_kernels=false"])
    assert precompile.start(off, config, 40, torch.device("cuda"), loaded=True) is None


def test_each_kernel_goes_to_exactly_one_share():
    pytest.importorskip("triton")
    from triton import knobs

    before = knobs.runtime.jit_cache_hook
    try:
        kernels = [{"specialization_data": json.dumps({"name": f"k{i}", "constants": {"BLOCK": i % 7}})}
                   for i in range(60)]
        owners = []
        for share in range(4):
            precompile.compile_share(share, 4)
            hook = knobs.runtime.jit_cache_hook
            owners.append([not hook(key=None, repr="", compile=k, fn=None, is_manual_warmup=False,
                                    already_compiled=False) for k in kernels])
        assert all(sum(column) == 1 for column in zip(*owners))  # compiled by one share, skipped by the others
        assert all(any(row) for row in owners)  # every share gets some of 60
    finally:
        knobs.runtime.jit_cache_hook = before


def test_a_worker_runs_its_whole_path(config, tmp_path):
    """The worker's stand-in, update micro-batch and rollout at every bucket, as `Precompile` starts it (its own
    process); on the CPU no kernel is compiled, but every line of the path runs."""
    s = load_settings(overrides=["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8",
                                 "grpo.micro_batch_size=2"])
    job = precompile.jobs(s, config, 24, torch.device("cpu"), 1)[0]
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, "-m", "qerl.rl.precompile", str(tmp_path / "job.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "share 0/1:" in proc.stdout and "update" in proc.stdout and "rollout" in proc.stdout


def test_a_failed_worker_is_a_warning_and_leaves_no_stamp(tmp_path, caplog):
    bad = {"config": {"model_type": "llama"}, "share": 0, "shares": 1}  # a config the stand-in cannot build
    stamp = tmp_path / "stamps" / "x"
    with caplog.at_level(logging.WARNING, logger="qerl.rl.precompile"):
        ok = precompile.Precompile([bad], stamp).wait(timeout_s=300)
    assert not ok and not stamp.exists()
    assert "kernel precompile worker 0 failed" in caplog.text and "the first step compiles its share" in caplog.text
    # it names where in our code it failed: a library's bare assert (humming's shape checks) says nothing of that
    assert re.search(r'File "[^"]*qerl[^"]*\.py", line \d+, in \w+', caplog.text), caplog.text


def test_stopped_workers_leave_no_process_and_no_stamp(config, tmp_path):
    """What the trainer does when its start fails after starting the workers (e.g. the base does not load)."""
    s = load_settings(overrides=["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8"])
    job = precompile.jobs(s, config, 24, torch.device("cpu"), 1)[0]
    stamp = tmp_path / "stamps" / "x"
    workers = precompile.Precompile([job], stamp)
    workers.stop()
    assert all(proc.poll() is not None for proc, _ in workers.workers) and not stamp.exists()


def test_the_first_step_bench_counts_only_the_trainers_own_slow_compiles(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_first_step
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    log = tmp_path / "compile.jsonl"
    rows = [{"pid": 7, "s": 0.8, "fn": "qerl.kernels.gluon_nvfp4.nvfp4_decode_gemm_kernel"},
            {"pid": 7, "s": 0.002, "fn": "qerl.execution.fused_ops._sample_kernel"},  # found on disk
            {"pid": 9, "s": 0.6, "fn": "qerl.execution.fused_ops._sample_kernel"}]  # a worker's
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench_first_step.compiled_by(7, log) == [("nvfp4_decode_gemm_kernel", 0.8)]
    assert bench_first_step.compiled_by(7, tmp_path / "none.jsonl") == []
    table = bench_first_step.table([{"arm": "cold", "setup_s": 2.5, "first_step_s": 25.9, "step_s": 12.6,
                                     "compiled": [("a", 0.5), ("b", 0.25)]}])
    assert "| cold | 2.5 | 25.9 | 12.6 | 2.06x | 28.4 | 2 (0.8 s) |" in table
