"""Issue 49's CPU-testable parts: the staging that carries vLLM and the peers' packages to a GPU machine in parts
(benchmarks/stage_vllm.sh `archive` / `receive`, on real files with the real zstd, tar and sha256sum), and
benchmarks/bench_peers.py's arm selection, its table, and a vLLM arm saying why it cannot run here."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGE_SCRIPT = ROOT / "benchmarks" / "stage_vllm.sh"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peers = _module("bench_peers")
needs_zstd = pytest.mark.skipif(shutil.which("zstd") is None, reason="the zstd command packs the archive")


# ------------------------------------------------------------------------------------------------ staging


def _checkout(where: Path) -> Path:
    """A repository as a device call sees it: the script, and whatever parts the call carries."""
    (where / "benchmarks").mkdir(parents=True)
    shutil.copy(STAGE_SCRIPT, where / "benchmarks" / "stage_vllm.sh")
    return where


def _stage(checkout: Path, *args: str, stage: Path, part_mb: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "QERL_VLLM_STAGE": str(stage), "QERL_VLLM_PART_MB": str(part_mb)}
    return subprocess.run(["bash", str(checkout / "benchmarks" / "stage_vllm.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Three folders as `pack peers` leaves them (vLLM's site, the peers', Unsloth's), archived into 1 MiB parts."""
    work = tmp_path_factory.mktemp("work")
    payload = random.Random(0).randbytes(2_500_000)  # incompressible: the archive needs three parts of 1 MiB
    for folder, package in (("site", "fake_vllm"), ("peers", "fake_trl"), ("unsloth", "fake_unsloth")):
        (work / folder / package).mkdir(parents=True)
        (work / folder / package / "__init__.py").write_text(f"NAME = {package!r}\n")
    (work / "site" / "fake_vllm" / "kernels.so").write_bytes(payload)
    packer = _checkout(tmp_path_factory.mktemp("here"))
    done = _stage(packer, "archive", str(work), "site", "peers", "unsloth", stage=work / "unused")
    assert done.returncode == 0, done.stderr
    parts = sorted(p.name for p in (packer / ".vllm").iterdir())
    return packer, parts, payload


@needs_zstd
def test_the_archive_travels_in_parts_and_unpacks_once_the_last_has_come(packed, tmp_path):
    packer, parts, payload = packed
    assert parts == ["1", "2", "3"]
    digest, count = (packer / ".vllm" / "1" / "manifest").read_text().split()
    assert count == "3" and len(digest) == 64
    stage = tmp_path / "stage"
    for i, part in enumerate(parts, 1):  # one call per part, each carrying its own folder only
        call = _checkout(tmp_path / f"call{part}")
        shutil.copytree(packer / ".vllm" / part, call / ".vllm" / part)
        done = _stage(call, "receive", stage=stage)
        assert done.returncode == 0, done.stderr
        assert f"{i} of 3 parts" in done.stdout
        assert (stage / "env").exists() == (i == 3)  # nothing unpacked before the last part
    assert "unpacked into" in done.stdout
    assert (stage / "site" / "fake_vllm" / "kernels.so").read_bytes() == payload
    # The env puts vLLM's site and the peers' folder on the path, and names Unsloth's for its arms only.
    probe = ("import fake_vllm, fake_trl, os; print(fake_vllm.NAME, fake_trl.NAME, os.environ['PEERS_UNSLOTH_SITE'],"
             " os.environ['VLLM_USE_FLASHINFER_SAMPLER'])")
    out = subprocess.run(["bash", "-c", f". {stage}/env && {sys.executable} -c \"{probe}\""], capture_output=True,
                         text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fake_vllm", "fake_trl", str(stage / "unsloth"), "0"]
    again = _stage(call, "receive", stage=stage)
    assert again.returncode == 0 and "already unpacked" in again.stdout


@needs_zstd
def test_a_part_damaged_on_the_way_is_refused_and_nothing_is_unpacked(packed, tmp_path):
    packer, parts, _ = packed
    call = _checkout(tmp_path / "call")
    shutil.copytree(packer / ".vllm", call / ".vllm")
    damaged = call / ".vllm" / "2" / "part.1"
    data = bytearray(damaged.read_bytes())
    data[1000] ^= 0xFF
    damaged.write_bytes(bytes(data))
    stage = tmp_path / "stage"
    done = _stage(call, "receive", stage=stage)
    assert done.returncode == 1 and "checksum mismatch" in done.stdout
    assert not (stage / "env").exists() and not (stage / "site").exists()


def test_pack_names_an_unknown_set_in_one_line_and_exits_2(tmp_path):
    done = _stage(_checkout(tmp_path), "pack", "peer", stage=tmp_path / "stage")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["stage_vllm: pack takes 'peers' or nothing, not 'peer'"]
    assert not (tmp_path / ".vllm").exists()


# ------------------------------------------------------------------------------------------------ bench_peers


def test_arms_take_their_row_count_and_bad_entries_are_named():
    assert peers.parse_arms("trl-vllm@128,qerl-nvfp4", peers.GPU_ARMS, 64) == [("trl-vllm", 128), ("qerl-nvfp4", 64)]
    assert peers.parse_arms("all", peers.CPU_ARMS, 64) == [(arm, 64) for arm in peers.CPU_ARMS]
    assert set(peers.VLLM_ARMS) <= set(a for a, _ in peers.parse_arms("", peers.GPU_ARMS, 64))
    with pytest.raises(ValueError, match="unknown arm 'trl-vlm' in 'trl-vlm@64'"):
        peers.parse_arms("trl,trl-vlm@64", peers.GPU_ARMS, 64)
    with pytest.raises(ValueError, match="rows in 'trl-vllm@100' must be a positive multiple of the group size 8"):
        peers.parse_arms("trl-vllm@100", peers.GPU_ARMS, 64)


def test_each_qerl_arm_runs_the_setting_its_name_says():
    assert peers.qerl_arm_settings("qerl-nvfp4") == ("nvfp4", ())
    assert peers.qerl_arm_settings("qerl-nf4-bnb") == ("nf4-bnb", ())
    assert peers.qerl_arm_settings("qerl-nvfp4-ckpt") == ("nvfp4", ("model.gradient_checkpointing=true",))
    assert peers.qerl_arm_settings("qerl-nvfp4-fp8") == ("nvfp4", ("model.base_gemm=fp8",))
    for arm in peers.GPU_ARMS:  # every qerl arm on the menu resolves to a scheme the CLI knows
        if arm.startswith("qerl-"):
            assert peers.qerl_arm_settings(arm)[0] in ("nvfp4", "bf16", "nf4-bnb")


def test_an_unknown_arm_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--arms", "unsloth-vllm",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"bench_peers: --arms: unknown arm 'unsloth-vllm' in 'unsloth-vllm' (arms: {', '.join(peers.GPU_ARMS)})"]
    assert not (tmp_path / "out").exists()  # nothing written for a run that did not start
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--rows", "60",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bench_peers: --rows 60 must be a positive multiple of the group size 8"]


def test_the_table_compares_each_row_count_with_its_own_trl_and_qerl_lines():
    def ran(arm, rows, step, peak, **kv):
        return {"arm": arm, "rows": rows, "steps": 2, "step_s": step, "first_step_s": step, "cpu_s_per_step": 1.0,
                "peak_gib": peak, **kv}

    rows = [ran("qerl-nvfp4", 64, 10.0, 30.0, device_peak_gib=32.0),
            ran("trl", 64, 100.0, 20.0, device_peak_gib=22.0),
            ran("trl-vllm", 64, 40.0, 18.0, device_peak_gib=64.0, generate_s=15.0, sync_s=2.0, update_s=25.0),
            ran("qerl-nvfp4", 128, 16.0, 40.0, device_peak_gib=42.0),
            {"arm": "unsloth-vllm-4bit", "rows": 128, "unavailable": "vllm is not installed",
             "reached": {"model_loaded_s": 3.0}}]
    lines = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in peers.table(rows, "cuda").splitlines()}
    # 64 rows: against TRL + vLLM (not TRL with generate), memory on the device's peak, qerl's speed-up
    assert "| 0.25x vs trl-vllm | 0.50x | 1.00x |" in lines[("qerl-nvfp4", "64")]
    assert "| 2.50x vs trl-vllm | 0.34x | 10.00x |" in lines[("trl", "64")]
    assert "| 15.0 (2.0 sync) | 25.0 |" in lines[("trl-vllm", "64")]
    # 128 rows: no TRL line at that size, so no ratio against one
    assert "| - | - | 1.00x |" in lines[("qerl-nvfp4", "128")]
    assert "did not run: vllm is not installed (reached: model_loaded_s 3.0)" in lines[("unsloth-vllm-4bit", "128")]


def test_the_table_is_drawn_into_a_png_and_a_run_where_nothing_ran_is_one_line(tmp_path):
    ran = {"steps": 2, "first_step_s": 30.0, "cpu_s_per_step": 1.0, "peak_gib": 40.0}
    rows = [{"arm": "qerl-nvfp4", "rows": 64, "step_s": 11.0, "generate_s": 6.0, "update_s": 5.0, **ran},
            {"arm": "trl-vllm", "rows": 64, "step_s": 20.0, "generate_s": 7.0, "sync_s": 0.2, "update_s": 13.0,
             "device_peak_gib": 57.0, **ran},
            {"arm": "unsloth-vllm-4bit", "rows": 128, "unavailable": "no time left"}]
    runs = tmp_path / "peers.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--table", str(runs)]
    done = subprocess.run([*script, "--plot", str(tmp_path / "plots" / "peers.png")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    png = (tmp_path / "plots" / "peers.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "| qerl-nvfp4 | 64 | 11.00 |" in done.stdout  # the table is printed as before
    runs.write_text(json.dumps(rows[-1]) + "\n")
    done = subprocess.run([*script, "--plot", str(tmp_path / "none.png")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"bench_peers: --plot {tmp_path / 'none.png'}: no arm in these rows ran: nothing to plot"]
    assert not (tmp_path / "none.png").exists()


def test_a_vllm_arm_that_cannot_run_here_says_why_and_the_run_goes_on(tmp_path):
    """The CPU dry run of a vLLM arm: its process reports the package it lacks (TRL, or vLLM where TRL is
    installed) as its row, exit 0, and the table says so; nothing hangs on the missing engine."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--device", "cpu", "--tiny",
                           "--arms", "trl-vllm@16", "--steps", "1", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [json.loads(line) for line in (out / "peers.jsonl").read_text().splitlines()]
    missing = "vllm" if importlib.util.find_spec("trl") else "trl"
    assert row["arm"] == "trl-vllm" and row["rows"] == 16
    assert row["unavailable"].startswith(f"{missing} is not installed"), row
    assert f"| trl-vllm | 16 | did not run: {missing} is not installed" in done.stdout


def test_without_nvml_an_arm_runs_without_the_device_figure_and_says_so(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("NVML answers on a GPU machine")
    assert peers.DevicePeak.begin("bench_peers") is None
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("bench_peers: no device memory figure (")
