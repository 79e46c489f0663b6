"""Where the FP8 update's time goes, per GEMM of the 7B's shapes at a training micro-batch (M = 4 x 1,280 tokens):
the bf16 path (dequantize into bf16 + cuBLAS) against the FP8 path (dequantize into E4M3 + per-row quantization of
the activations + `torch._scaled_mm`), and each part alone. CUDA-graph timings (qerl.kernels.dispatch.graph_time).

    PYTHONPATH=. python3 benchmarks/bench_fp8_gemm.py [--m 5120]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qerl.kernels import gemm, gluon_nvfp4  # noqa: E402
from qerl.kernels.dispatch import graph_time  # noqa: E402
from qerl.quant import nvfp4 as codec  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=5120)
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | M = {args.m}")
    compiled_rows = torch.compile(gemm.fp8_rows_reference, dynamic=True)  # what fp8_rows was before its Triton kernel
    print("| layer | N x K | bf16 path µs | fp8 path µs | dequant bf16 | dequant fp8 | x to fp8 (torch.compile) | mm bf16 | "
          "_scaled_mm | TFLOP/s bf16 / fp8 mm |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        d = codec.quantize(torch.randn(n, k, generator=g))
        layer = gemm.NVFP4Gemm(*(d[key].cuda() for key in ("weight_packed", "weight_scale", "weight_global_scale")),
                               prefer="gluon")
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        w16 = layer.dequantize(torch.bfloat16)
        s_n, inv_n, _, _ = layer._fp8_scales()
        w8 = gluon_nvfp4.dequantize(*layer.gluon, torch.float8_e4m3fn, inv_scale=inv_n)
        xq, s_x = gemm.fp8_rows(x)
        t = {
            "bf16": graph_time(lambda: layer._forward("dequant_cublas", x)),
            "fp8": graph_time(lambda: layer._forward_fp8(x)),
            "deq16": graph_time(lambda: layer.dequantize(torch.bfloat16)),
            "deq8": graph_time(lambda: gluon_nvfp4.dequantize(*layer.gluon, torch.float8_e4m3fn, inv_scale=inv_n,
                                                              out=w8)),
            "x8": graph_time(lambda: gemm.fp8_rows(x)),
            "x8c": graph_time(lambda: compiled_rows(x)),
            "mm16": graph_time(lambda: x @ w16.t()),
            "mm8": graph_time(lambda: torch._scaled_mm(xq, w8.t(), scale_a=s_x, scale_b=s_n[None, :],
                                                       out_dtype=torch.bfloat16)),
        }
        flop = 2 * args.m * n * k
        print(f"| {name} | {n}x{k} | {t['bf16'] * 1e6:.0f} | {t['fp8'] * 1e6:.0f} | {t['deq16'] * 1e6:.0f} | "
              f"{t['deq8'] * 1e6:.0f} | {t['x8'] * 1e6:.0f} ({t['x8c'] * 1e6:.0f}) | {t['mm16'] * 1e6:.0f} | "
              f"{t['mm8'] * 1e6:.0f} | "
              f"{flop / t['mm16'] / 1e12:.0f} / {flop / t['mm8'] / 1e12:.0f} |", flush=True)


def bf16_base(m: int) -> None:
    """The bf16 base's FP8 update (qerl/quant/fp8.py): cuBLAS bf16 against W quantized per call + x per row +
    `_scaled_mm`, forward and dx, and each part alone."""
    from qerl.quant import fp8

    print(f"\nbf16 base (qerl.quant.fp8), M = {m}")
    print("| layer | N x K | fwd bf16 µs | fwd fp8 µs | dx bf16 | dx fp8 | W to fp8 | Wᵀ to fp8 | x to fp8 | "
          "_scaled_mm fwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
        s_n, inv_n, s_k, inv_k = fp8._scales(linear)
        w = linear.weight
        w8 = fp8.weight_fp8(w, inv_n, False)
        fp8.weight_fp8(w, inv_k, True)
        xq, s_x = gemm.fp8_rows(x)
        t = {
            "fwd16": graph_time(lambda: x @ w.t()),
            "fwd8": graph_time(lambda: fp8._product(x, fp8.weight_fp8(w, inv_n, False), s_n)),
            "dx16": graph_time(lambda: dy @ w),
            "dx8": graph_time(lambda: fp8._product(dy, fp8.weight_fp8(w, inv_k, True), s_k)),
            "w8": graph_time(lambda: fp8.weight_fp8(w, inv_n, False)),
            "wt8": graph_time(lambda: fp8.weight_fp8(w, inv_k, True)),
            "x8": graph_time(lambda: gemm.fp8_rows(x)),
            "mm8": graph_time(lambda: torch._scaled_mm(xq, w8.t(), scale_a=s_x, scale_b=s_n[None, :],
                                                       out_dtype=torch.bfloat16)),
        }
        print(f"| {name} | {n}x{k} | " + " | ".join(f"{t[key] * 1e6:.0f}" for key in t) + " |", flush=True)


if __name__ == "__main__":
    main()
    bf16_base(int(os.environ.get("FP8_M", "5120")))
