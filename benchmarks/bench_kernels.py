"""NVFP4 GEMM backends vs cuBLAS bf16 vs bitsandbytes NF4, on Qwen2.5-7B/32B shapes and two untuned families.

    PYTHONPATH=. python3 benchmarks/bench_kernels.py [--models 7b,32b,llama8b,qwen3-14b] [--m 1,16,...] [--out DIR]

Columns, all in one run: cuBLAS bf16 (the baseline), our Triton fused kernel, humming-kernels' GEMM, our
dequantize + cuBLAS, bitsandbytes NF4 (`bnb.matmul_4bit`, QLoRA's kernel), and what qerl's dispatch picked
(qerl.kernels.dispatch: measured on this GPU, cached). Forward at every M; backward dx = dy W at M = 2048.
Graph-replay timing (CUDA graphs, median of replays); weight copies rotate so each format's working set is
>= 3x L2. Prints a markdown table (also DIR/bench.md, DIR/bench.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qerl.kernels import nvfp4_ops  # noqa: E402
from qerl.kernels import nvfp4 as K  # noqa: E402
from qerl.quant import nvfp4 as codec  # noqa: E402

LAYERS = {
    "7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "32b": [("qkv", 7168, 5120), ("o", 5120, 5120), ("gate_up", 55296, 5120), ("down", 5120, 27648)],
    # never tuned on: the dispatch must generalize to them
    "llama8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "qwen3-14b": [("qkv", 7168, 5120), ("o", 5120, 5120), ("gate_up", 34816, 5120), ("down", 5120, 17408)],
}
MS = [1, 16, 64, 128, 256, 2048]


def capture(fns, target_ms=3.0):
    """(graph, calls per replay) for fns (one per weight copy), replayed `inner` times per graph launch."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    inner = max(1, min(64, math.ceil(target_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    return g, inner * len(fns)


def interleaved_us(columns: dict, rounds=15) -> dict:
    """µs per call for each column (a list of calls, or None), all captured first and then replayed in turn,
    round after round: every column sees the same clocks and temperature (a column timed last in a long row
    would otherwise pay for the heat of the ones before it). A column that fails to capture is NaN."""
    graphs, out = {}, {}
    for name, fns in columns.items():
        if fns is None:
            out[name] = float("nan")
            continue
        try:
            graphs[name] = capture(fns)
        except Exception as e:  # a missing optional library or a failed capture is a blank cell, not a crash
            print(f"  ({name}: {type(e).__name__}: {str(e)[:160]})", flush=True)
            out[name] = float("nan")
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, (g, calls) in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) * 1e3 / calls)
    out.update({name: statistics.median(ts) for name, ts in times.items()})
    del graphs
    return out


def event_time_us(fns, reps=3) -> float:
    for f in fns[:1]:
        f()
    times = []
    for _ in range(reps):
        for f in fns:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return statistics.median(times) * 1e3


def ceilings() -> tuple[float, float]:
    """(device copy TB/s counting read + write, bf16 8192^3 matmul TFLOP/s), measured here."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB fp32; a copy kernel, not a graph memcpy node
    dst = torch.empty_like(src)
    us = event_time_us([lambda: torch.mul(src, 1.0, out=dst)], reps=10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us_mm = interleaved_us({"mm": [lambda: a @ b]})["mm"]
    return 2 * src.numel() * 4 / us / 1e6, 2 * 8192**3 / us_mm / 1e6


def copies_for(nbytes: int, l2: int) -> int:
    return max(1, min(32, math.ceil(3 * l2 / nbytes)))


def dequant_table(hw, out, kernel="table_layout_dequant_kernel", kb=4, nb=2, warps=4):
    """W^T of a HummingWeight into out with one of our table-layout kernels and tile shapes (the comparison of
    the dequantize alone; HummingWeight.dequantize runs the chosen one)."""
    from qerl.kernels import _triton_nvfp4 as tk

    code_tbl, scale_tbl, xor = hw.tables
    getattr(tk, kernel)[(-(-hw.k // (16 * kb)), -(-hw.n // (64 * nb)))](
        hw.layer.weight.view(torch.int32), hw.layer.weight_scale.view(torch.uint8), hw.global_scale, code_tbl,
        scale_tbl, out, hw.n, hw.k, xor, BLOCK_KB=kb, BLOCK_NB=nb, TRANSPOSED=True, num_warps=warps)
    return out


DEQ_VARIANTS = {"prod 4x2 w4": ("table_layout_dequant_kernel", 4, 2, 4),
                "prod 2x2 w4": ("table_layout_dequant_kernel", 2, 2, 4),
                "prod 4x1 w4": ("table_layout_dequant_kernel", 4, 1, 4),
                "prod 8x1 w4": ("table_layout_dequant_kernel", 8, 1, 4),
                "prod 2x4 w4": ("table_layout_dequant_kernel", 2, 4, 4),
                "prod 4x2 w8": ("table_layout_dequant_kernel", 4, 2, 8),  # what HummingWeight.dequantize runs
                "prod 1x4 w2": ("table_layout_dequant_kernel", 1, 4, 2)}


def dequant_row(layer, N, Kd, nv, hum, nf4, bnb, bw) -> dict:
    """µs to write one layer's bf16 W^T (the fixed cost of every dequant + cuBLAS call) per kernel."""
    buf = torch.empty(Kd, N, device="cuda", dtype=torch.bfloat16)
    cols = {name: [lambda h=h.humming, v=v: dequant_table(h, buf, *v) for h in hum] or None
            for name, v in DEQ_VARIANTS.items()}
    cols["qerl layout"] = [lambda q=q: K.dequantize(*q, torch.bfloat16, out=buf.view(N, Kd)) for q in nv]
    cols["bnb NF4"] = [lambda p=p, s=s: bnb.functional.dequantize_4bit(p, s) for p, s in nf4] or None
    t = interleaved_us(cols)
    same = None
    if hum:
        ref = dequant_table(hum[0].humming, torch.empty_like(buf), "table_layout_dequant_kernel").clone()
        same = {}
        for name, v in DEQ_VARIANTS.items():
            try:
                same[name] = torch.equal(dequant_table(hum[0].humming, torch.empty_like(buf), *v).view(torch.int16),
                                         ref.view(torch.int16))
            except Exception as e:  # a tile shape the compiler rejects is a blank cell
                same[name] = type(e).__name__
        same = all(v is True for k, v in same.items() if t.get(k) == t.get(k)) or same
    floor = (N * Kd // 2 + N * Kd // 16 + 2 * N * Kd) / bw / 1e6
    print(f"{layer:28s} dequantize W^T: " + " | ".join(f"{k} {v:.1f}" for k, v in t.items())
          + f" | floor {floor:.1f} us | variants bit-identical: {same}", flush=True)
    return dict(layer=layer, floor_us=floor, identical=same, **{f"{k}_us": v for k, v in t.items()})


def _try(fn) -> float:
    try:
        return fn()
    except Exception as e:  # a missing optional library or a failed capture is a blank cell, not a crash
        print(f"  ({type(e).__name__}: {str(e)[:160]})", flush=True)
        return float("nan")


def main() -> None:
    from qerl.kernels import dispatch, humming_nvfp4
    from qerl.kernels.gemm import NVFP4Gemm

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="7b,32b,llama8b,qwen3-14b")
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dequant-only", action="store_true", help="only the dequantize-alone table")
    args = ap.parse_args()
    assert torch.cuda.is_available() and nvfp4_ops.available(), "needs CUDA + triton"
    try:
        import bitsandbytes as bnb
    except Exception as e:
        bnb = None
        print(f"bitsandbytes unavailable: {e}")
    print(f"humming-kernels {humming_nvfp4.version()} usable: {humming_nvfp4.available()} "
          f"({humming_nvfp4.IMPORT_ERROR})")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_properties(0)
    l2 = dev.L2_cache_size
    bw, peak = ceilings()
    print(f"# {dev.name}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{dev.multi_processor_count} SMs, L2 {l2 >> 20} MiB; copy {bw:.2f} TB/s, bf16 mm {peak:.0f} TFLOP/s",
          flush=True)
    ms_list = [int(m) for m in args.m.split(",")]
    rows, deq_rows = [], []
    torch.manual_seed(0)
    cols = ("cublas", "triton", "humming", "deq_cublas", "bnb", "qerl")
    for model in args.models.split(","):
        for name, N, Kd in LAYERS[model]:
            layer = f"{model} {name} {N}x{Kd}"
            nv_bytes = N * Kd // 2 + N * Kd // 16
            r_nv, r_bf = copies_for(nv_bytes, l2), copies_for(2 * N * Kd, l2)
            nv = [K.quantize((torch.randn(N, Kd, device="cuda") * 0.02).bfloat16()) for _ in range(max(r_nv, r_bf))]
            wbf = [codec.dequantize(*nv[i], dtype=torch.bfloat16) for i in range(r_bf)]
            nv = nv[:r_nv]
            hum = [NVFP4Gemm(*q, prefer="humming") for q in nv] if humming_nvfp4.available() else []
            mine = [NVFP4Gemm(*q) for q in nv]  # what qerl runs: layout and backends as the dispatch picks
            nf4 = []
            if bnb is not None:
                for w in wbf[:r_nv]:
                    packed, state = bnb.functional.quantize_4bit(w, quant_type="nf4", blocksize=64)
                    nf4.append((packed, state))
            for M in [] if args.dequant_only else ms_list + ["bwd"]:
                bwd = M == "bwd"
                m = 2048 if bwd else M
                x = torch.randn(m, N if bwd else Kd, device="cuda", dtype=torch.bfloat16)
                with torch.inference_mode():
                    if bwd:
                        cols_fns = dict(
                            cublas=[lambda w=w: x @ w for w in wbf],
                            triton=[lambda q=q: K.grad_input(x, *q) for q in nv],
                            humming=None,
                            deq_cublas=[lambda g=g: g.grad_input(x, "dequant_cublas") for g in (hum or mine)],
                            # QLoRA's backward: dequantize NF4, then matmul (what bnb's MatMul4Bit does)
                            bnb=[lambda p=p, s=s: x @ bnb.functional.dequantize_4bit(p, s) for p, s in nf4] or None,
                            qerl=[lambda g=g: g.grad_input(x) for g in mine])
                        pick = mine[0].backend_for("bwd", x)
                    else:
                        cols_fns = dict(
                            cublas=[lambda w=w: F.linear(x, w) for w in wbf],
                            triton=[lambda q=q: K.linear_forward(x, *q) for q in nv],
                            humming=[lambda g=g: g.forward(x, "humming") for g in hum] or None,
                            deq_cublas=[lambda g=g: g.forward(x, "dequant_cublas") for g in (hum or mine)],
                            bnb=[lambda p=p, s=s: bnb.matmul_4bit(x, p.t(), quant_state=s) for p, s in nf4] or None,
                            qerl=[lambda g=g: g.forward(x) for g in mine])
                        for g in mine[:1]:
                            g.forward(x)  # the dispatch measures (once) outside the timed graphs
                        pick = mine[0].backend_for("fwd", x)
                    t = interleaved_us(cols_fns)
                    if nf4 and t["bnb"] != t["bnb"]:  # bnb that will not capture: timed eagerly
                        t["bnb"] = _try(lambda: event_time_us(cols_fns["bnb"], reps=5))
                    if bwd:
                        ref = x.float() @ codec.dequantize(*nv[0], dtype=torch.float32)
                        y = mine[0].grad_input(x)
                    else:
                        ref = x.float() @ codec.dequantize(*nv[0], dtype=torch.float32).T
                        y = mine[0].forward(x)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                flops = 2 * m * N * Kd
                row = dict(layer=layer, M=str(M), pick=pick, layout=mine[0].layout, err=err,
                           floor_us=max((nv_bytes + 2 * m * (N + Kd)) / bw / 1e6, flops / peak / 1e6),
                           **{f"{c}_us": t[c] for c in cols})
                row["vs_cublas"] = t["cublas"] / t["qerl"]
                row["vs_bnb"] = t["bnb"] / t["qerl"]
                rows.append(row)
                print(f"{layer:28s} M={M!s:5s} " + " ".join(f"{c} {t[c]:8.1f}" for c in cols)
                      + f" | x{row['vs_cublas']:.2f} cuBLAS x{row['vs_bnb']:.2f} bnb | {pick} err {err:.1e}", flush=True)
            with torch.inference_mode():
                deq_rows.append(dequant_row(layer, N, Kd, nv, hum, nf4, bnb, bw))
            del nv, wbf, hum, mine, nf4
            torch.cuda.empty_cache()

    md = [f"Device: {dev.name} ({dev.multi_processor_count} SMs, L2 {l2 >> 20} MiB); torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, humming-kernels {humming_nvfp4.version()}, bitsandbytes "
          f"{getattr(bnb, '__version__', None)}. Ceilings: copy {bw:.2f} TB/s (read+write), bf16 matmul {peak:.0f} TFLOP/s.",
          "", "µs per call (CUDA-graph replay, weights rotated past L2); M = bwd is dx = dy·W at M = 2048.", "",
          "| layer (N×K) | M | cuBLAS bf16 | Triton fused | humming | deq + cuBLAS | bnb NF4 | **qerl** | qerl vs cuBLAS "
          "| qerl vs bnb | picked (layout) | floor µs |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['layer']} | {r['M']} | {r['cublas_us']:.1f} | {r['triton_us']:.1f} | {r['humming_us']:.1f} | "
                  f"{r['deq_cublas_us']:.1f} | {r['bnb_us']:.1f} | **{r['qerl_us']:.1f}** | {r['vs_cublas']:.2f}× | "
                  f"{r['vs_bnb']:.2f}× | {r['pick']} ({r['layout']}) | {r['floor_us']:.1f} |")
    if deq_rows:
        names = [k[:-3] for k in deq_rows[0] if k.endswith("_us") and k != "floor_us"]
        md += ["", "Dequantize alone (bf16 W^T into a reused buffer), µs; floor = 0.56 B read + 2 B written per weight "
               "at the measured copy bandwidth.", "",
               "| layer | " + " | ".join(names) + " | floor | bit-identical |", "|---" * (len(names) + 3) + "|"]
        md += [f"| {r['layer']} | " + " | ".join(f"{r[n + '_us']:.1f}" for n in names)
               + f" | {r['floor_us']:.1f} | {r['identical']} |" for r in deq_rows]
    text = "\n".join(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(rows=rows, dequant=deq_rows, copy_tbs=bw, mm_tflops=peak, device=dev.name,
                       dispatch_env=dispatch.environment_key()), f, indent=1)
    print(text)
    bad = [(r["layer"], r["M"], r["err"]) for r in rows if not r["err"] < 5e-3]
    if bad:
        print("CHECK FAILED:", bad)
        sys.exit(1)


if __name__ == "__main__":
    main()
