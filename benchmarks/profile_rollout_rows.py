"""Where a decode step of our engine goes at few rows: wall time per step against the GPU's busy time, and the
kernels by time, for each row count (one process, one model).

Why: one-row figures read 286 then 183 tok/s at 7B NVFP4 (2026-11-27, 2026-11-28) while 8 rows did not move
(BENCHMARKS.md, "Beside vLLM, completed"). A rollout is timed here after a warm one, so one-time work stays out;
if the GPU is busy most of the step, its kernels bound it, and if it idles, the host loop between graph replays.

    PYTHONPATH=. python3 benchmarks/profile_rollout_rows.py --model 7b --scheme nvfp4 --rows 1,8
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import build_model, random_prompts  # noqa: E402

from qerl.rollout.engine import RolloutEngine  # noqa: E402


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds during which at least one kernel ran (kernels overlap under programmatic dependent launch)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile_rows(engine: RolloutEngine, rows: int, prompt: int, new: int, vocab: int, cuda: bool, top: int) -> None:
    engine.prepare(rows, prompt, new)
    prompts = random_prompts(rows, prompt, vocab)
    engine.generate(None, prompts, new, temperature=1.0, eos_token_ids=[], seed=0)  # warm: graphs captured, JIT done
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.generate(None, prompts, new, temperature=1.0, eos_token_ids=[], seed=0)
    sync()
    wall_us = (time.perf_counter() - t0) * 1e6 / new
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        engine.generate(None, prompts, new, temperature=1.0, eos_token_ids=[], seed=0)
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / new
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    print(f"\nrows {rows}: {wall_us:,.0f} us a step unprofiled ({rows * 1e6 / wall_us:,.0f} tok/s), GPU busy "
          f"{busy:,.0f} us a step ({busy / wall_us:.0%}), {len(kernels) / new:.0f} kernels a step", flush=True)
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(times) / new:8.1f} us  {len(times) / new:6.1f}x  {name[:110]}")
    host = sorted(((e.self_cpu_time_total, e.key, e.count) for e in prof.key_averages()), reverse=True)[:top]
    print("  host (self CPU us a step, calls a step):")
    for us, key, count in host:
        print(f"  {us / new:8.1f} us  {count / new:6.1f}x  {key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--scheme", default="nvfp4")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    model = build_model(args.model, args.scheme, device=args.device)
    engine = RolloutEngine(model)
    print(f"{args.model} {args.scheme}: graphs {engine.use_graphs}, fused kernels {engine.kernels}", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        profile_rows(engine, rows, args.prompt, args.new, model.config.vocab_size, cuda, args.top)


if __name__ == "__main__":
    main()
