"""The training flow runs the trainer's own loop: on a tiny random Llama, `flows.train` (Prefect's temporary server,
each phase a task) writes what `qerl train` writes for the same parameters, DAPO resampling rounds included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.test_distributed import TIMINGS
from tests.test_trainer import adapter_tensors

pytest.importorskip("prefect")

ROOT = Path(__file__).resolve().parent.parent


def odd_gold_length_reward(completion: str, gold: str) -> float:
    """Informative only for odd golds: an even-gold group scores 0 throughout, so DAPO must draw again."""
    return len(completion) / 100 if int(gold) % 2 else 0.0


@pytest.fixture
def params_file(tmp_path, tiny_llama_dir) -> Path:
    """params/tiny.yaml on the tiny random Llama (bf16 base: nothing to quantize), DAPO dynamic sampling on."""
    raw = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())
    raw["model"]["path"] = str(tiny_llama_dir)
    raw["quant"]["scheme"] = "bf16"
    raw["grpo"].update(dynamic_sampling=True, max_resample_rounds=2)
    raw["train"].update(steps=3, rewards={f"{__name__}:odd_gold_length_reward": 1.0})
    raw["rollout"]["max_new_tokens"] = raw["eval"]["max_new_tokens"] = 8
    raw["tracking"]["backend"] = "none"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def task_run_counts(flow_run_id) -> dict[str, int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    counts: dict[str, int] = {}
    for r in runs:
        name = r.name.rsplit("-", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_the_flow_writes_what_the_command_line_writes_resampling_rounds_as_tasks(tmp_path, params_file, monkeypatch):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.train import train
    from qerl.cli import main as qerl_main

    assert qerl_main(["train", "--params", str(params_file), "--out", str(tmp_path / "cli")]) == 0
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_HOME: str(tmp_path / "prefect-home"), PREFECT_API_URL: None}):
        state = train(params=str(params_file), out_dir=str(tmp_path / "flow"), return_state=True)
        result = state.result()
        tasks = task_run_counts(state.state_details.flow_run_id)

    expected, got = metrics(tmp_path / "cli"), metrics(tmp_path / "flow")
    assert [m["step"] for m in got] == [1, 2, 3]
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        assert {k: e[k] for k in e.keys() - TIMINGS} == {k: g[k] for k in g.keys() - TIMINGS}
    ta, tb = adapter_tensors(tmp_path / "cli"), adapter_tensors(tmp_path / "flow")
    assert ta.keys() == tb.keys() and all((ta[k] == tb[k]).all() for k in ta)
    checkpoints = sorted(p.name for p in (tmp_path / "cli" / "checkpoints").iterdir())
    assert sorted(p.name for p in (tmp_path / "flow" / "checkpoints").iterdir()) == checkpoints

    rounds = sum(m["dynamic_sampling/rounds"] for m in got)
    assert rounds > len(got), "no step resampled: the test's data should draw an even-gold question"
    assert tasks["generate-rollouts"] == tasks["score-rewards"] == rounds  # each round is a task of its own
    assert tasks["grpo-update"] == 3 and tasks["export-adapter"] == 1
    assert tasks["evaluate"] == 3  # after steps 1 and 2 (train.eval_every: 1), and the final one
    assert (tmp_path / "flow" / "eval" / "step-000002" / "metrics.json").is_file()
    assert result["steps"] == 3 and Path(result["adapter"]) == tmp_path / "flow" / "adapter"
