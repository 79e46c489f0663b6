"""Dequantize time per NVFP4 layout: what the training path (dequantize + cuBLAS) pays per GEMM before cuBLAS.

    PYTHONPATH=. python3 benchmarks/bench_dequant.py [--models 7b,32b] [--out DIR]

Per layer shape, bf16, W [N, K] and W^T [K, N]: the Gluon layout's dequantize (one 64 x 128 block per program),
humming's layout's, and ours ("qerl": W^T is a view, no kernel). Each result is first checked bit for bit against
the codec. CUDA-graph timing with weights rotated past L2 (bench_kernels' timers), all columns in one run; µs per
call and GB/s of bf16 written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_kernels import LAYERS, copies_for, interleaved_us  # noqa: E402
from qerl.kernels import gluon_nvfp4 as G  # noqa: E402
from qerl.kernels import nvfp4 as K  # noqa: E402
from qerl.kernels.gemm import NVFP4Gemm  # noqa: E402
from qerl.kernels import humming_nvfp4  # noqa: E402
from qerl.quant import nvfp4 as codec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="7b,32b")
    ap.add_argument("--layers", default="gate_up,down")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name}; humming usable: {humming_nvfp4.available()}", flush=True)
    rows: list[dict] = []
    torch.manual_seed(0)
    for model in args.models.split(","):
        for name, n, k in LAYERS[model]:
            if name not in args.layers.split(","):
                continue
            reps = copies_for(n * k // 2 + n * k // 16, dev.L2_cache_size)
            q = [K.quantize((torch.randn(n, k, device="cuda") * 0.02).bfloat16()) for _ in range(reps)]
            ref = codec.dequantize(*q[0], dtype=torch.bfloat16)
            out = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
            shuf = [G.shuffle_weight(p, s) + (gs,) for p, s, gs in q]
            hum = [NVFP4Gemm(*t, prefer="humming") for t in q] if humming_nvfp4.available() else []
            ours = [NVFP4Gemm(*t, prefer="qerl") for t in q]
            for transposed in (False, True):
                want = ref.t() if transposed else ref
                cols = {}
                got = G.dequantize(*shuf[0], torch.bfloat16, transposed, out=out)
                assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16))
                cols["gluon"] = [lambda s=s: G.dequantize(*s, torch.bfloat16, transposed, out=out) for s in shuf]
                for label, gs_ in (("humming", hum), ("qerl", ours)):
                    if gs_:
                        got = gs_[0].dequantize(torch.bfloat16, transposed, out=out)
                        assert torch.equal(got.contiguous().view(torch.int16), want.contiguous().view(torch.int16))
                        cols[label] = [lambda g=g: g.dequantize(torch.bfloat16, transposed, out=out) for g in gs_]
                with torch.inference_mode():
                    t = interleaved_us(cols)
                row = dict(layer=f"{model} {name} {n}x{k}", transposed=transposed, us=t)
                rows.append(row)
                print(f"{row['layer']:26s} {'W^T' if transposed else 'W  '} " + "  ".join(
                    f"{c} {v:6.1f} us ({2 * n * k / v / 1e3:5.0f} GB/s)" for c, v in t.items()), flush=True)
            del q, shuf, hum, ours
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dequant.json"), "w") as f:
        json.dump(dict(device=dev.name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
