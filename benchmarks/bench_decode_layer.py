"""The fixed cost of a decode step per layer: what a layer costs beyond reading its base weights.

    PYTHONPATH=. python3 benchmarks/bench_decode_layer.py --model 7b --batch 8[,1,64] --window 512 \
        [--schemes bf16,nvfp4] [--projections fused,separate] [--profile] [--out DIR]

For each scheme, with q/k/v and gate/up fused (`Transformer.fuse_projections`) and then separate, on random weights
of the published shape with LoRA r=16 on every linear, three CUDA-graph timings (median of 5 runs of 50 replays):
  step   the engine's captured `Transformer.decode_step` (batch bucket, KV window), as a rollout replays it;
  gemms  a graph of only the base GEMMs that step runs (same layers, same shapes, same backends) plus lm_head;
  fixed  (step - gemms) / layers: norms, RoPE + KV write, attention, SiLU·up, the LoRA GEMMs, launch gaps.
With --profile, the replayed step's kernels by name (µs per step and per layer) and how much of the step they fill.
And the eager sampling of one token (`qerl.rollout.sampling.sample_tokens`, temperature 1) that runs between replays.
Results: DIR/decode_layer.jsonl and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import build_model, free_cuda  # noqa: E402
from qerl.execution import fusion  # noqa: E402
from qerl.model.lora import LoraLinear  # noqa: E402
from qerl.rollout.engine import RolloutEngine  # noqa: E402
from qerl.rollout.sampling import sample_tokens  # noqa: E402


def base(m):
    return m.base if isinstance(m, LoraLinear) else m


def graph_us(fn, replays: int = 50, runs: int = 5) -> float:
    """Median µs per call of `fn` captured in a CUDA graph (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return replay_us(graph, replays, runs)


def replay_us(graph, replays: int = 50, runs: int = 5) -> float:
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def base_gemms(model, rows: int):
    """A function running the base GEMMs of a decode step (fused groups where the model has them) on static
    inputs, as the step runs them."""
    c = model.config
    dev, dt = model.lm_head.weight.device, torch.bfloat16
    h = torch.randn(rows, c.hidden_size, device=dev, dtype=dt)
    attn_out = torch.randn(rows, c.num_attention_heads * c.head_dim, device=dev, dtype=dt)
    act = torch.randn(rows, c.intermediate_size, device=dev, dtype=dt)
    calls = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for block, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            group = block.__dict__.get(fusion.GROUP_ATTR)
            if group is not None:
                calls.append((group.fused, h))
            else:
                calls += [(base(getattr(block, n)), h) for n in names]
        calls += [(base(attn.o_proj), attn_out), (base(mlp.down_proj), act)]
    calls.append((model.lm_head, h))

    def run():
        for layer, x in calls:
            layer(x)
    return run


def print_replay_profile(graph, steps: int, layers: int) -> None:
    """Kernel time per decode step by kernel name (µs per step and per layer, launches per layer) for `steps`
    replays of `graph`, and the busy fraction: how much of the replay's span kernels ran (the rest is launch gaps)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    graph.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()]
    if not kernels:
        print("  (the profiler saw no kernels of the replay)", flush=True)
        return
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    print(f"  replay profile: {len(kernels) / steps:.0f} kernels per step ({len(kernels) / steps / layers:.1f} per "
          f"layer), busy {busy / steps:.0f} of {span / steps:.0f} µs per step ({100 * busy / span:.0f}%)")
    print("  | kernel | µs per step | µs per layer | launches per layer | µs each |")
    print("  |---|---|---|---|---|")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:24]:
        total = sum(times) / steps
        print(f"  | {name[:90]} | {total:.0f} | {total / layers:.1f} | {len(times) / steps / layers:.2f} | "
              f"{sum(times) / len(times):.1f} |", flush=True)


@torch.no_grad()
def measure(model, batch: int, window: int, profile: bool = False, kv: str = "model") -> dict:
    engine = RolloutEngine(model, kv_cache_dtype=kv)
    prompt = window // 2
    engine.prepare(batch, prompt, window - prompt)
    rows = engine.bucket(batch)
    graph = engine.graphs[(rows, window)]
    engine._install(batch, window)  # the caches the graph reads stay installed while it replays
    try:
        step = replay_us(graph)
    finally:
        engine._uninstall()
    gemms = graph_us(base_gemms(model, rows))
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = engine.logits_buf[:rows]
    for _ in range(3):
        sample_tokens(logits, 1.0, 1.0, 0, gen)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        sample_tokens(logits, 1.0, 1.0, 0, gen)
    torch.cuda.synchronize()
    sample = (time.perf_counter() - t0) / 50 * 1e6
    layers = model.config.num_hidden_layers
    if profile:  # the kernels of the replayed graph, per step, and the gaps between them
        engine._install(batch, window)
        try:
            print_replay_profile(graph, steps=5, layers=model.config.num_hidden_layers)
        finally:
            engine._uninstall()
    engine.free()
    return {"step_us": step, "gemms_us": gemms, "fixed_per_layer_us": (step - gemms) / layers,
            "sample_us": sample, "rows": rows, "window": window}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--schemes", default="bf16,nvfp4")
    ap.add_argument("--batch", default="8", help="batch sizes, comma-separated")
    ap.add_argument("--projections", default="fused,separate")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kv", default="model", help="rollout.kv_cache_dtype: model or fp8")
    ap.add_argument("--profile", action="store_true", help="also print the kernels of the replayed step (profiler)")
    ap.add_argument("--lora-epilogue", action="store_true", help="execution.lora_epilogue: LoRA in the GEMM epilogue")
    ap.add_argument("--out", default="outputs/bench")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    rows = []
    with open(os.path.join(args.out, "decode_layer.jsonl"), "a") as log:
        for scheme in args.schemes.split(","):
            model = build_model(args.model, scheme, lora_epilogue=args.lora_epilogue)
            for projections in args.projections.split(","):
                if projections == "separate":
                    fusion.unfuse_projections(model)
                for batch in map(int, args.batch.split(",")):
                    r = measure(model, batch, args.window, args.profile, args.kv)
                    r.update(model=args.model, scheme=scheme, projections=projections, batch=batch, kv=args.kv)
                    rows.append(r)
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                    print(f"  {scheme} {projections} batch {batch}: step {r['step_us']:.0f} µs, base GEMMs "
                          f"{r['gemms_us']:.0f} µs, fixed {r['fixed_per_layer_us']:.1f} µs/layer, sampling "
                          f"{r['sample_us']:.0f} µs", flush=True)
            del model
            free_cuda()
    print("\n| model | scheme | projections | batch | step µs | base GEMMs µs | fixed µs / layer | sampling µs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['scheme']} | {r['projections']} | {r['batch']} | {r['step_us']:.0f} | "
              f"{r['gemms_us']:.0f} | {r['fixed_per_layer_us']:.1f} | {r['sample_us']:.0f} |")


if __name__ == "__main__":
    main()
