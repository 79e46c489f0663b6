"""The FP8 base's forward past decode sizes (M = 32-512: a ragged rollout's first steps, a large batch) with 16-bit
activations, at 7B shapes: what the dispatch chooses between (kernels/fp8_gemm.py) and a few other wide tiles.
Per (shape, M), microseconds of: cuBLAS bf16 (the bf16 base), `_scaled_mm` W8A8 (what `quant.fp8_activations: true`
runs), the one-pass dequantize + cuBLAS and the chunked torch dequantize it replaced + cuBLAS, the narrow W8A16
tile (M <= 64) and the wide tiles. Each checked against the fp32 product first.

    PYTHONPATH=. python3 benchmarks/diag/sweep_w8a16_wide.py          # one H200, ~1 min
"""
import json
import sys

import torch
import triton.testing

from qerl.kernels import fp8_w8a16
from qerl.kernels.fp8_gemm import fp8_rows

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
# (max rows per tile, columns, depth, warps, stages); the first is TILES["triton_wide"]
WIDE = [fp8_w8a16.TILES["triton_wide"], (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 128, 4, 4),
        (128, 256, 64, 8, 3), (64, 256, 64, 8, 3)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3


def main() -> int:
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev) * 0.02
        scale = (w.abs().amax(1) / 448).contiguous()
        w8 = (w / scale[:, None]).to(torch.float8_e4m3fn).contiguous()
        wb = (w8.float() * scale[:, None]).bfloat16()
        scratch = torch.empty(n, k, dtype=torch.bfloat16, device=dev)

        def old_dequant():
            step = max(1, (1 << 24) // k)
            for r in range(0, n, step):
                scratch[r:r + step] = w8[r:r + step].float() * scale[r:r + step, None]
            return scratch

        assert torch.equal(fp8_w8a16.dequantize(w8, scale, scratch), wb), name
        for m in (32, 64, 128, 256, 512):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wb.float().t()
            row = {"shape": name, "m": m, "cublas_bf16_us": bench(lambda: x @ wb.t())}
            xq, xs = fp8_rows(x)
            row["scaled_mm_us"] = bench(lambda: torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale[None, :],
                                                                  out_dtype=torch.bfloat16))
            row["dequant_new_cublas_us"] = bench(lambda: x @ fp8_w8a16.dequantize(w8, scale, scratch).t())
            row["dequant_old_cublas_us"] = bench(lambda: x @ old_dequant().t())
            row["dequant_new_us"] = bench(lambda: fp8_w8a16.dequantize(w8, scale, scratch))
            if m <= fp8_w8a16.MAX_M:
                row["narrow_us"] = bench(lambda: fp8_w8a16.tiled_forward("triton", x, w8, scale))
            for bm, bn, bk, warps, stages in WIDE:
                fn = lambda: fp8_w8a16.linear_forward(x, w8, scale, block_n=bn, block_k=bk, num_warps=warps,  # noqa
                                                      num_stages=stages, max_block_m=bm)
                try:
                    y = fn()
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    row[f"wide_{bm}x{bn}x{bk}_w{warps}s{stages}_us"] = bench(fn) if err < 1e-2 else f"err {err:.2g}"
                except Exception as e:  # noqa: BLE001 - a tile the GPU cannot hold
                    row[f"wide_{bm}x{bn}x{bk}_w{warps}s{stages}_us"] = type(e).__name__
            rows.append(row)
            print(json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k not in ("shape", "m")]
    print("| shape | M | " + " | ".join(k.removesuffix("_us") for k in keys) + " |")
    print("|" + " --- |" * (len(keys) + 2))
    for r in rows:
        cells = [f"{r.get(k):.1f}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys]
        print(f"| {r['shape']} | {r['m']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
