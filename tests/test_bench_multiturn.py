"""benchmarks/bench_multiturn.py dry-runs on the CPU (the GPU run is the lead's: 7B shapes on an H200)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_the_multi_turn_benchmark_dry_runs_on_the_cpu(tmp_path, capsys):
    import bench_multiturn

    assert bench_multiturn.main(["--model", "tiny", "--scheme", "bf16", "--device", "cpu", "--batch", "3",
                                 "--prompt", "8", "--turns", "2", "--turn-tokens", "8", "--answer-tokens", "4",
                                 "--latency", "0.02", "--out", str(tmp_path)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "multiturn.jsonl").read_text().splitlines()]
    single, multi = rows
    assert single["arm"] == "single-turn" and multi["arm"] == "multi-turn"
    assert multi["tool_calls"] == 3 * 2 and single["tool_calls"] == 0
    assert multi["generated_per_s"] < multi["tokens_per_s"] and 0 <= multi["idle_share"] < 1
    assert "vs single-turn" in capsys.readouterr().out
