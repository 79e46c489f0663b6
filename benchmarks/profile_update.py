"""Where the GRPO update's GPU time goes: torch.profiler over the second step's update of bench_grpo_step's work
(the 7B of the published shape, 64 x (256 + 1,024) tokens, micro-batch 4; --prompt, --new, --micro change them), as
`qerl train` runs it.

    PYTHONPATH=.:benchmarks python3 benchmarks/profile_update.py --scheme nvfp4 --set model.base_gemm=fp8 --out DIR

Writes DIR/<label>.txt (the kernels and ops by device time) and prints the update's seconds and its top kernels.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
from torch._C._profiler import _ExperimentalConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_grpo_step as g  # noqa: E402
from qerl.rl import update as update_module  # noqa: E402


def write_stacks(prof, names: set[str], path: str, depth: int = 6) -> None:
    """For each op in `names`, its call sites by count (the innermost `depth` frames of ours, i.e. outside
    site-packages): which lines launch the small kernels."""
    sites: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.name in names:
            frames = tuple(f for f in e.stack if not f.startswith("<built-in") and "site-packages" not in f)[:depth]
            sites[(e.name, frames)] += 1
    with open(path, "w") as f:
        for (name, frames), count in sites.most_common(80):
            f.write(f"{name}  {count}x\n" + "".join(f"    {fr}\n" for fr in frames) + "\n")
    print(f"call sites of {', '.join(sorted(names))}: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--scheme", default="nvfp4")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (e.g. 2048 with --new 512)")
    ap.add_argument("--new", type=int, default=1024, help="completion tokens")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--set", action="append", default=[], help="a setting, key=value (repeatable)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default="outputs/profile")
    ap.add_argument("--stacks", default="", help="comma-separated op names (e.g. aten::fill_,aten::copy_): also "
                    "write <label>_stacks.txt, where each is called from (Python stacks; slows the profiled update)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    label = "_".join([args.model, args.scheme, f"{args.prompt}+{args.new}x{args.micro}",
                      *[s.replace("=", "-") for s in args.set]])
    optimize, calls = update_module.PolicyUpdate._optimize, []

    def profiled(self, *a, **k):
        calls.append(1)
        if len(calls) < 2:  # the first update pays compilation and dispatch measurement
            return optimize(self, *a, **k)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA],
                                    with_stack=bool(args.stacks),  # verbose: Python frames in the stacks
                                    experimental_config=_ExperimentalConfig(verbose=True) if args.stacks else None
                                    ) as prof:
            result = optimize(self, *a, **k)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=60, max_name_column_width=90)
        with open(os.path.join(args.out, f"{label}.txt"), "w") as f:
            f.write(f"update under the profiler: {seconds:.2f} s\n{table}\n")
        events = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / 1e6
        print(f"[{label}] update {seconds:.2f} s under the profiler; GPU kernels {total:.2f} s")
        for e in events[:args.top]:
            print(f"  {e.device_time_total / 1e6:6.3f} s  {e.count:6d}x  {e.key[:110]}")
        if args.stacks:
            write_stacks(prof, set(args.stacks.split(",")), os.path.join(args.out, f"{label}_stacks.txt"))
        return result

    update_module.PolicyUpdate._optimize = profiled
    g.grpo_step(args.model, args.scheme, prompt_len=args.prompt, new=args.new, micro=args.micro, steps=2,
                overrides=tuple(args.set))


if __name__ == "__main__":
    main()
