"""The W8A16 decode GEMM (kernels/fp8_w8a16.py) over tile sizes, split-K and pipeline depth at 7B shapes and M = 1, 8,
16, beside cuBLAS bf16 and torch._scaled_mm (what the FP8 base's dispatch chooses between): microseconds and the
share of HBM bandwidth its 1-byte codes stream at. Issue #63's rollout target (FP8 >= 1.25x bf16 at 1 and 8 rows)
needs this GEMM near HBM rate; on 2026-12-02 it ran 10-52 us per GEMM, as fast as bf16's cuBLAS.

    PYTHONPATH=. python3 benchmarks/diag/sweep_w8a16.py           # one H200, ~1 min
"""
import itertools
import json
import sys

import torch
import triton
import triton.testing

from qerl.kernels import fp8_w8a16
from qerl.kernels.fp8_gemm import fp8_rows

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
HBM = 4.8e12  # H200 bytes/s


def main() -> int:
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev) * 0.02
        scale = w.abs().amax(1) / 448
        w8 = (w / scale[:, None]).to(torch.float8_e4m3fn).contiguous()
        wb = w.bfloat16()
        for m in (1, 8, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = (x.float() @ (w8.float() * scale[:, None]).t())
            cublas = triton.testing.do_bench(lambda: x @ wb.t(), warmup=25, rep=100) * 1e3
            best = None
            for bn, bk, warps, stages, split in itertools.product((32, 64, 128), (128, 256), (4,), (3, 4, 5),
                                                                  (None, 1)):
                try:
                    fn = lambda: fp8_w8a16.linear_forward(x, w8, scale, block_n=bn, block_k=bk, num_warps=warps,  # noqa
                                                          split_k=split, num_stages=stages)
                    y = fn()
                    if ((y.float() - ref).norm() / ref.norm()).item() > 1e-2:
                        continue
                    us = triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3
                except Exception:  # noqa: BLE001 - a config the GPU cannot hold
                    continue
                if best is None or us < best[0]:
                    best = (us, dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split))
            default = triton.testing.do_bench(lambda: fp8_w8a16.linear_forward(x, w8, scale), warmup=25, rep=100) * 1e3
            xq, xs = fp8_rows(torch.cat([x, x.new_zeros(16 - m if m < 16 else 0, k)]))
            scaled = triton.testing.do_bench(lambda: torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale[None, :],
                                                                      out_dtype=torch.bfloat16), warmup=25, rep=100) * 1e3
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_bf16_us": cublas, "scaled_mm_us": scaled,
                   "w8a16_default_us": default, "w8a16_best_us": best[0], "best": best[1],
                   "best_hbm_share": n * k / (best[0] * 1e-6) / HBM, "bf16_hbm_share": 2 * n * k / (cublas * 1e-6) / HBM}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| shape | M | cuBLAS bf16 µs | _scaled_mm µs | W8A16 default µs | W8A16 best µs (HBM share) | best config |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['m']} | {r['cublas_bf16_us']:.1f} | {r['scaled_mm_us']:.1f} | "
              f"{r['w8a16_default_us']:.1f} | {r['w8a16_best_us']:.1f} ({r['best_hbm_share']:.0%}) | {r['best']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
