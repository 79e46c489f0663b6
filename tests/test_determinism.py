"""What a CPU run's numbers depend on, as the README's "Determinism" states it: the code, torch's build and the CPU's
instruction set, and the thread count (`model.cpu_threads`, recorded by every run); not the machine's load."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.patience import patience
from tests.test_trainer import make_trainer, tiny_settings


@pytest.fixture
def threads_restored():
    """torch's thread count is process-wide: give the next test the count this one found."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def metrics(run) -> list[dict]:
    """Every step's numbers but its timings and memory (which do depend on the load)."""
    timing = ("seconds", "tokens_per_s", "memory")
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_thread_count_is_pinned_recorded_and_named_on_resume(tmp_path, threads_restored, caplog):
    run = tmp_path / "run"
    with make_trainer(tiny_settings(tmp_path, model={"cpu_threads": 1}, train={"steps": 2, "save_every": 1}),
                      run) as trainer:
        assert torch.get_num_threads() == 1
        trainer.train()
    assert yaml.safe_load((run / "params.yaml").read_text())["model"]["cpu_threads"] == 1

    torch.set_num_threads(2)  # a machine with two cores, and the setting left to torch
    with make_trainer(tiny_settings(tmp_path, train={"steps": 2, "save_every": 1}), tmp_path / "unset") as trainer:
        assert trainer.settings.model.cpu_threads == 2  # what torch used is what the run records
    with make_trainer(tiny_settings(tmp_path, train={"steps": 3, "save_every": 1}), run, resume=True) as trainer:
        trainer.train()
    changed = [r.getMessage() for r in caplog.records if "settings changed" in r.getMessage()]
    assert len(changed) == 1 and "model.cpu_threads 1 -> 2" in changed[0], changed


def test_the_same_steps_beside_busy_processes_give_the_same_numbers(tmp_path, threads_restored):
    """Two processes spinning on the cores while the second run trains: every metric but the timings, and the
    adapter, bit for bit (the thread count is fixed; only the scheduling changes)."""
    settings = tiny_settings(tmp_path, model={"cpu_threads": 2}, train={"steps": 3, "save_every": 3})
    with make_trainer(settings, tmp_path / "idle") as trainer:
        trainer.train()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        with make_trainer(settings, tmp_path / "busy") as trainer:
            trainer.train()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(patience(10))
    assert metrics(tmp_path / "busy") == metrics(tmp_path / "idle")
    idle, busy = (load_file(tmp_path / r / "adapter" / "adapter_model.safetensors") for r in ("idle", "busy"))
    assert idle.keys() == busy.keys() and all(torch.equal(idle[k], busy[k]) for k in idle)
