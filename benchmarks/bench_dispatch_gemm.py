"""The product's NVFP4 GEMM (qerl.kernels.gemm.NVFP4Gemm.forward: the dispatch picks the backend per shape and M, measured
on this GPU) against cuBLAS bf16 on the same shape, at the M of RL batches: decoding 64-512 rows and a prefill chunk
of 2,048 tokens. Shapes: the 7B's layers, and layers of sizes no model of ours has ("never named": the dispatch has
no prior for them). Two arms of the product: with the resident FP8 copy (quant.fp8_weights on: what `auto` gives a
7B on an 80 GB+ GPU) and 4-bit only (quant.fp8_weights: false). CUDA-graph timings (qerl.kernels.dispatch.graph_time),
median; every call's inputs rotate over 4 sets so L2 does not hold them.

    PYTHONPATH=. python3 benchmarks/bench_dispatch_gemm.py [--m 64,128,256,512,2048] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qerl.kernels import dispatch, gemm  # noqa: E402
from qerl.kernels.dispatch import graph_time  # noqa: E402
from qerl.quant import nvfp4 as codec  # noqa: E402

SHAPES = {  # name: (N, K)
    "7b qkv": (4608, 3584), "7b o": (3584, 3584), "7b gate_up": (37888, 3584), "7b down": (3584, 18944),
    "unnamed 5120x2560": (5120, 2560), "unnamed 12288x4096": (12288, 4096), "unnamed 2816x7168": (2816, 7168),
    "unnamed 24576x6144": (24576, 6144),
}


SETS = 4  # input sets per timed call: their activations together exceed L2, as in a real step


def per_call_us(fn, xs: list[torch.Tensor]) -> float:
    """Median µs of fn(x), over a graph that runs it on every input set in turn."""
    return graph_time(lambda: [fn(x) for x in xs]) * 1e6 / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="64,128,256,512,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        t = codec.quantize(w)
        parts = (t["weight_packed"], t["weight_scale"], t["weight_global_scale"])
        arms = {"fp8 copy": gemm.NVFP4Gemm(*parts, fp8_weights=True), "4-bit only": gemm.NVFP4Gemm(*parts)}
        wq = codec.dequantize(*parts, torch.bfloat16)
        for m in (int(x) for x in args.m.split(",")):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
            with torch.no_grad():
                ref = (xs[0].double() @ wq.t().double())
                row = {"shape": name, "n": n, "k": k, "m": m, "cublas_bf16_us": per_call_us(lambda x: x @ wq.t(), xs)}
                for arm, layer in arms.items():
                    picked = layer.backend_for("fwd", xs[0])  # measured now, as the first real call would
                    err = ((layer.forward(xs[0]).double() - ref).norm() / ref.norm()).item()
                    row[arm] = {"backend": picked, "us": per_call_us(layer.forward, xs), "rel_err": err}
            rows.append(row)
            print(f"{name:>20} M={m:<5} cuBLAS bf16 {row['cublas_bf16_us']:8.1f} us | " + " | ".join(
                f"{arm}: {row[arm]['backend']} {row[arm]['us']:8.1f} us ({row['cublas_bf16_us'] / row[arm]['us']:.2f}x,"
                f" err {row[arm]['rel_err']:.3f})" for arm in arms), flush=True)
        del arms, w, wq, t
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "dispatch_gemm.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("\n| shape | M | cuBLAS bf16 µs | product, FP8 copy (backend) | vs cuBLAS | product, 4-bit only (backend) "
          "| vs cuBLAS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        a, b = r["fp8 copy"], r["4-bit only"]
        print(f"| {r['shape']} | {r['m']} | {r['cublas_bf16_us']:.1f} | {a['us']:.1f} ({a['backend']}) | "
              f"{r['cublas_bf16_us'] / a['us']:.2f}x | {b['us']:.1f} ({b['backend']}) | "
              f"{r['cublas_bf16_us'] / b['us']:.2f}x |")
    print(f"(dispatch cache: {dispatch.default_cache_path()})")


if __name__ == "__main__":
    main()
