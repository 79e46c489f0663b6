"""The first GRPO step on a fresh machine against a steady one, with and without `model.precompile_kernels`.

Each arm is `bench_grpo_step.py`'s (the trainer as `qerl train` runs it, random weights in a published shape) in its
own process, 2 steps:
- `cold`: empty Triton and GEMM-dispatch caches, what a machine's first run sees;
- `cold-precompile`: the same with the kernels compiled in worker processes (`qerl.rl.precompile`);
- `warm`: the caches the precompile arm left, what every later run sees (its stamp skips the workers).
Prints each arm's trainer setup, first and steady step, their ratio, setup + first step, and the Triton kernels the
trainer's own process compiled (its `_do_compile` calls over 50 ms, recorded by benchmarks/compile_log). The model
is built before the trainer here, so nothing overlaps the workers: in `qerl train` they run while the base loads.

    PYTHONPATH=. python3 benchmarks/bench_first_step.py --model 7b --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SLOW_S = 0.05  # a _do_compile call that found its kernel on disk takes milliseconds


def compiled_by(pid: int, log: Path) -> list[tuple[str, float]]:
    """(kernel, seconds) of each compile over SLOW_S that process `pid` made, from a compile_log file."""
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [(r["fn"].rsplit(".", 1)[-1], r["s"]) for r in rows if r["pid"] == pid and r["s"] > SLOW_S]


def run_arm(label: str, model: str, scheme: str, caches: Path, precompile: bool, out: Path) -> dict:
    row, log = out / f"{label}.json", out / f"{label}.compile.jsonl"
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"), QERL_GEMM_CACHE=str(caches / "gemm.json"),
               QERL_COMPILE_LOG=str(log), PYTHONPATH=os.pathsep.join(
                   filter(None, [str(HERE.parent), str(HERE / "compile_log"), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(HERE / "bench_grpo_step.py"), "--arm", model, scheme, label, "--row", str(row),
           "--steps", "2", "--set", f"model.precompile_kernels={str(precompile).lower()}"]
    with open(out / f"{label}.log", "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        rc = proc.wait()
    if rc != 0 or not row.exists():
        raise SystemExit(f"arm {label} failed (exit {rc}); see {out / (label + '.log')}")
    r = json.loads(row.read_text())
    r.update(arm=label, compiled=compiled_by(proc.pid, log))
    return r


def table(rows: list[dict]) -> str:
    lines = ["| arm | trainer setup s | first step s | steady step s | first / steady | setup + first s | "
             "kernels the trainer compiled |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        kernels = f"{len(r['compiled'])} ({sum(s for _, s in r['compiled']):.1f} s)"
        lines.append(f"| {r['arm']} | {r['setup_s']:.1f} | {r['first_step_s']:.1f} | {r['step_s']:.1f} | "
                     f"{r['first_step_s'] / r['step_s']:.2f}x | {r['setup_s'] + r['first_step_s']:.1f} | {kernels} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--scheme", default="nvfp4")
    ap.add_argument("--out", default="outputs/first_step")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qerl-first-step-") as tmp:
        cold, pre = Path(tmp) / "cold", Path(tmp) / "pre"
        rows = [run_arm("cold", args.model, args.scheme, cold, False, out),
                run_arm("cold-precompile", args.model, args.scheme, pre, True, out),
                run_arm("warm", args.model, args.scheme, pre, True, out)]
    with open(out / "first_step.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
