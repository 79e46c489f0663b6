"""NVFP4 kernels vs cuBLAS bf16 vs plain-PyTorch dequantize-then-matmul, Qwen2.5-7B/32B layer shapes.

    PYTHONPATH=. python3 benchmarks/bench_kernels.py [--check] [--tune] [--out DIR]

Graph-replay timing (CUDA graphs, median of replays) for cuBLAS and our kernels; event timing for the
PyTorch path (its codec moves a lookup table to the GPU per call, which a graph cannot capture). Weight
copies rotate so that each format's working set is >= 3x L2. Prints a markdown table (also written to
DIR/bench.md, with every autotune candidate's time in DIR/tune.txt).
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
import kernels  # noqa: E402
from kernels import nvfp4 as K  # noqa: E402
from qerl.quant import nvfp4 as codec  # noqa: E402

LAYERS = {
    "7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "32b": [("qkv", 7168, 5120), ("o", 5120, 5120), ("gate_up", 55296, 5120), ("down", 5120, 27648)],
}
MS = [1, 16, 64, 256, 2048, 8192]


def graph_time_us(fns, target_ms=3.0, replays=10) -> float:
    """Median µs per call of fns (one per weight copy), captured into one CUDA graph and replayed."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    est_ms = (time.perf_counter() - t0) * 1e3
    inner = max(1, min(64, math.ceil(target_ms / max(est_ms, 1e-3))))
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
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times) * 1e3 / (inner * len(fns))


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
    us_mm = graph_time_us([lambda: a @ b])
    return 2 * src.numel() * 4 / us / 1e6, 2 * 8192**3 / us_mm / 1e6


def diag_quant() -> None:
    """Which torch arithmetic does the CUDA reference quantizer follow? (fp32 weights, one real shape)"""
    from kernels.reference import quantize_ref

    w = torch.randn(4608, 3584, device="cuda") * 0.02
    ours, ref = K.quantize(w), quantize_ref(w)
    gs = ref[2]
    blocks = w.view(4608, -1, 16)
    amax = blocks.abs().amax(-1)
    print(f"quant diag: scale bytes differ {(ours[1].view(torch.uint8) != ref[1].view(torch.uint8)).sum().item()}, "
          f"packed bytes differ {(ours[0] != ref[0]).sum().item()}")
    for name, q in (("amax*fp32(1/6)", amax * torch.tensor(1 / 6, device="cuda")), ("amax/6 (tensor)", amax / torch.full_like(amax, 6.0)),
                    ("amax/6 (py)", amax / 6.0)):
        sc = (gs * q).clamp(-448, 448).to(torch.float8_e4m3fn)
        sc = torch.where(sc.float() == 0, torch.full_like(sc, 0.125), sc)
        for dname, v in (("div", blocks / (sc.float() / gs).unsqueeze(-1)), ("mul-recip", blocks * (1 / (sc.float() / gs)).unsqueeze(-1))):
            packed = codec.pack_e2m1(codec.e2m1_round(v).flatten(-2))
            print(f"  {name:16s} {dname:9s}: scale!=ref {(sc.view(torch.uint8) != ref[1].view(torch.uint8)).sum().item()}, "
                  f"packed!=ref {(packed != ref[0]).sum().item()}, packed!=ours {(packed != ours[0]).sum().item()}")
    t = graph_time_us([lambda: K.quantize(w, gs)])
    print(f"  quantize 4608x3584 fp32: {t:.1f} us ({w.numel() * 4.56 / t / 1e6:.2f} TB/s)")


def copies_for(nbytes: int, l2: int) -> int:
    return max(1, min(32, math.ceil(3 * l2 / nbytes)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare every timed output with an fp32 reference")
    ap.add_argument("--tune", action="store_true", help="autotune each shape over the candidate configs")
    ap.add_argument("--models", default="7b,32b")
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--no-torch", action="store_true", help="skip the dequantize-then-matmul path at M > 64")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--diag", action="store_true", help="quantizer arithmetic diagnosis first")
    args = ap.parse_args()
    assert torch.cuda.is_available() and kernels.available(), "needs CUDA + triton"
    K.set_autotune(args.tune)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_properties(0)
    l2 = dev.L2_cache_size
    bw, peak = ceilings()
    print(f"# {dev.name}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{dev.multi_processor_count} SMs, L2 {l2 >> 20} MiB; copy {bw:.2f} TB/s, bf16 mm {peak:.0f} TFLOP/s",
          flush=True)
    if args.diag:
        diag_quant()
    ms_list = [int(m) for m in args.m.split(",")]
    rows, bwd_rows, bad = [], [], []
    torch.manual_seed(0)
    for model in args.models.split(","):
        for name, N, Kd in LAYERS[model]:
            layer = f"{model} {name} {N}x{Kd}"
            nv_bytes = N * Kd // 2 + N * Kd // 16
            r_nv, r_bf = copies_for(nv_bytes, l2), copies_for(2 * N * Kd, l2)
            nv = [K.quantize((torch.randn(N, Kd, device="cuda") * 0.02).bfloat16()) for _ in range(max(r_nv, r_bf))]
            wbf = [codec.dequantize(*nv[i], dtype=torch.bfloat16) for i in range(r_bf)]
            nv = nv[:r_nv]
            for M in ms_list:
                x = torch.randn(M, Kd, device="cuda", dtype=torch.bfloat16)
                with torch.inference_mode():
                    t_cublas = graph_time_us([lambda w=w: F.linear(x, w) for w in wbf])
                    t_ours = graph_time_us([lambda q=q: K.linear_forward(x, *q) for q in nv])
                    t_torch = (event_time_us([lambda q=q: kernels.linear_ref(x, *q) for q in nv[:2]])
                               if (M <= 64 or not args.no_torch) else float("nan"))
                    # what a non-fused large-M path would cost: our one-pass dequant kernel, then cuBLAS
                    t_hyb = (graph_time_us([lambda q=q: F.linear(x, K.dequantize(*q)) for q in nv])
                             if M >= 256 else float("nan"))
                    cfg = K._pick("fwd", M, N, Kd, torch.bfloat16, None)
                    if cfg.swap_ab or cfg.split_k:
                        cfg = K._resolve_fwd(cfg, M, N, Kd, x.device)
                    err = float("nan")
                    if args.check:
                        ref = x.float() @ codec.dequantize(*nv[0], dtype=torch.float32).T
                        y = K.linear_forward(x, *nv[0])
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        if not (err < 5e-3):
                            bad.append((layer, M, err))
                flops = 2 * M * N * Kd
                bytes_ours = nv_bytes + 2 * M * (N + Kd)
                row = dict(layer=layer, M=M, cublas_us=t_cublas, ours_us=t_ours, torch_us=t_torch, hyb_us=t_hyb,
                           vs_cublas=t_cublas / t_ours, vs_torch=t_torch / t_ours,
                           tbs=bytes_ours / t_ours / 1e6, tflops=flops / t_ours / 1e6,
                           cublas_tbs=(2 * N * Kd + 2 * M * (N + Kd)) / t_cublas / 1e6,
                           cublas_tflops=flops / t_cublas / 1e6,
                           floor_us=max(bytes_ours / bw / 1e6, flops / peak / 1e6), cfg=cfg.short(), err=err)
                rows.append(row)
                print(f"{layer:24s} M={M:5d} cuBLAS {t_cublas:9.1f} ours {t_ours:9.1f} torch {t_torch:9.1f} us"
                      f" | x{row['vs_cublas']:.2f} vs cuBLAS, x{row['vs_torch']:.1f} vs torch | "
                      f"{row['tbs']:.2f} TB/s {row['tflops']:.0f} TF/s | {cfg.short()} err {err:.1e}", flush=True)
            # backward dx = dy @ W at M = 2048
            M = 2048
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            with torch.inference_mode():
                tb_cublas = graph_time_us([lambda w=w: dy @ w for w in wbf])
                tb_ours = graph_time_us([lambda q=q: K.grad_input(dy, *q) for q in nv])
                tb_torch = (event_time_us([lambda q=q: kernels.grad_input_ref(dy, *q) for q in nv[:2]])
                            if not args.no_torch else float("nan"))
                tb_hyb = graph_time_us([lambda q=q: dy @ K.dequantize(*q) for q in nv])
                t_deq = graph_time_us([lambda q=q: K.dequantize(*q) for q in nv])
                print(f"{layer:24s} dequant kernel {t_deq:.1f} us, {(nv_bytes + 2 * N * Kd) / t_deq / 1e6:.2f} TB/s", flush=True)
                cfg = K._pick("bwd", M, N, Kd, torch.bfloat16, None)
                err = float("nan")
                if args.check:
                    ref = dy.float() @ codec.dequantize(*nv[0], dtype=torch.float32)
                    err = ((K.grad_input(dy, *nv[0]).float() - ref).norm() / ref.norm()).item()
                    if not (err < 5e-3):
                        bad.append((layer + " bwd", M, err))
            flops = 2 * M * N * Kd
            bwd_rows.append(dict(layer=layer, M=M, cublas_us=tb_cublas, ours_us=tb_ours, torch_us=tb_torch, hyb_us=tb_hyb,
                                 vs_cublas=tb_cublas / tb_ours, tflops=flops / tb_ours / 1e6,
                                 cublas_tflops=flops / tb_cublas / 1e6, cfg=cfg.short(), err=err))
            print(f"{layer:24s} BWD M={M} cuBLAS {tb_cublas:9.1f} ours {tb_ours:9.1f} torch {tb_torch:9.1f} us | "
                  f"x{tb_cublas / tb_ours:.2f} | {flops / tb_ours / 1e6:.0f} TF/s | {cfg.short()} err {err:.1e}",
                  flush=True)
            del nv, wbf
            torch.cuda.empty_cache()

    md = [f"Device: {dev.name} ({dev.multi_processor_count} SMs, L2 {l2 >> 20} MiB); torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}. Measured ceilings: copy {bw:.2f} TB/s (read+write), "
          f"bf16 matmul {peak:.0f} TFLOP/s.", "",
          "| layer (N×K) | M | cuBLAS bf16 µs | NVFP4 fused µs | PyTorch deq+mm µs | fused vs cuBLAS | fused vs PyTorch "
          "| fused TB/s | fused TFLOP/s | cuBLAS TB/s | floor µs | our deq kernel+cuBLAS µs | config |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['layer']} | {r['M']} | {r['cublas_us']:.1f} | {r['ours_us']:.1f} | {r['torch_us']:.0f} | "
                  f"{r['vs_cublas']:.2f}× | {r['vs_torch']:.1f}× | {r['tbs']:.2f} | {r['tflops']:.0f} | "
                  f"{r['cublas_tbs']:.2f} | {r['floor_us']:.1f} | {r['hyb_us']:.0f} | {r['cfg']} |")
    md += ["", "Backward dx = dy · W, M = 2048:", "",
           "| layer (N×K) | cuBLAS bf16 µs | NVFP4 fused µs | PyTorch deq+mm µs | fused vs cuBLAS | fused TFLOP/s "
           "| cuBLAS TFLOP/s | our deq kernel+cuBLAS µs | config |", "|---|---|---|---|---|---|---|---|---|"]
    for r in bwd_rows:
        md.append(f"| {r['layer']} | {r['cublas_us']:.1f} | {r['ours_us']:.1f} | {r['torch_us']:.0f} | "
                  f"{r['vs_cublas']:.2f}× | {r['tflops']:.0f} | {r['cublas_tflops']:.0f} | {r['hyb_us']:.0f} | {r['cfg']} |")
    text = "\n".join(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(rows=rows, bwd=bwd_rows, copy_tbs=bw, mm_tflops=peak, device=dev.name), f, indent=1)
    with open(os.path.join(args.out, "tuned.py"), "w") as f:  # winners, pasted into kernels/nvfp4.py _TABLE
        for (kind, mb, n, k, _), c in sorted(K._TUNED.items(), key=lambda kv: kv[0][:4]):
            f.write(f"    ({kind!r}, {mb}, {n}, {k}): Config({c.block_m}, {c.block_n}, {c.block_k}, {c.num_warps}, "
                    f"{c.num_stages}, swap_ab={c.swap_ab}, split_k={c.split_k}, x_mode={c.x_mode!r}),\n")
    with open(os.path.join(args.out, "tune.txt"), "w") as f:
        for key, res in K.TUNE_LOG.items():
            f.write(f"{key[0]} M<={key[1]} N={key[2]} K={key[3]}: "
                    + ", ".join(f"{c}={ms * 1e3:.1f}us" for c, ms in sorted(res, key=lambda r: r[1])) + "\n")
    print(text)
    print(f"inline-PTX dequant in use: {K._ASM_OK}")
    if bad:
        print("CHECK FAILED:", bad)
        sys.exit(1)


if __name__ == "__main__":
    main()
