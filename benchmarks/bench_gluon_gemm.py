"""The Gluon decode GEMM (kernels/gluon_nvfp4.py) vs cuBLAS bf16, our Triton kernel and humming-kernels, M <= 64.

    PYTHONPATH=. python3 benchmarks/bench_gluon_gemm.py [--models 7b,32b,llama8b,qwen3-14b] [--m 1,8,16,32,64]
                                                        [--configs default|sweep|w1s4k2p3r80L,...] [--out DIR]

Every cell in one run, graph-replay timing with weight copies rotated past L2 (bench_kernels' timers). Each Gluon
configuration is checked against the PyTorch reference before it is timed; a wrong or failing one is reported and
left out, never timed. Columns: µs per call, the best Gluon configuration, its speed-up over cuBLAS, and its
effective weight bandwidth as a share of the measured copy bandwidth (read + write, as the issue counts it).
Targets (issue 17): >= 2.8x cuBLAS at M <= 16 on gate_up and down, >= 2.0x at M = 64.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_kernels import LAYERS, ceilings, copies_for, interleaved_us  # noqa: E402
from qerl.kernels import gluon_nvfp4 as G  # noqa: E402
from qerl.kernels import nvfp4 as K  # noqa: E402
from qerl.quant import nvfp4 as codec  # noqa: E402


SPEC = re.compile(r"w(\d)s(\d+)(?:k(\d))?(?:p(\d))?(?:r(\d+))?(L?)$")


def parse_spec(spec: str) -> G.Config:
    """'w2s8k2p2r112L': W = 2 warpgroups, 8 stages of 2 K steps, 2 programs per SM, maxnreg 112, scale_lanes."""
    mt = SPEC.match(spec)
    if not mt:
        raise SystemExit(f"--configs: bad spec {spec!r} (want e.g. w1s8k2p2r128L)")
    w, stages, sub, per_sm, nreg, lanes = mt.groups()
    return G.Config(int(w), int(stages), per_sm=int(per_sm or 1), maxnreg=int(nreg) if nreg else None,
                    scale_lanes=bool(lanes), sub=int(sub or 1))


# the configurations that won somewhere on an H200 (BENCHMARKS.md, "The Gluon decode GEMM")
SWEEP = "w1s4k2p3r80L,w1s3k2p4r64L,w1s6k1p3r80L,w1s4k2p2r128L,w1s8p2r128L,w2s3k2L,w1s4k2L,w2s4L"


def configs(n: int, k: int, m: int, mode: str) -> dict[str, G.Config]:
    out = {"default": G.default_config(n, k, m)}
    if mode != "default":
        out.update({spec: parse_spec(spec) for spec in (SWEEP if mode == "sweep" else mode).split(",")})
    mp = G.padded_m(m)
    return {c: cfg for c, cfg in out.items() if n % (G.ROWS * cfg.w) == 0 and k % (G.BK * cfg.sub) == 0
            and G.shared_bytes(cfg, mp) <= G.SHARED_PER_SM}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="7b,32b,llama8b,qwen3-14b")
    ap.add_argument("--layers", default="gate_up,down,qkv,o")
    ap.add_argument("--m", default="1,8,16,32,64")
    ap.add_argument("--configs", default="sweep",
                    help="default, sweep, or a comma list of specs like w1s4k2p3r80L (W, stages, K steps per stage, "
                         "programs per SM, maxnreg, L = scale_lanes)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    assert G.available(), f"needs Gluon on an sm_90 GPU ({G.IMPORT_ERROR})"
    from qerl.kernels import humming_nvfp4
    from qerl.kernels.gemm import NVFP4Gemm
    dev = torch.cuda.get_device_properties(0)
    bw, peak = ceilings()
    print(f"# {dev.name}, torch {torch.__version__}, triton {__import__('triton').__version__}; copy {bw:.2f} TB/s, "
          f"bf16 mm {peak:.0f} TFLOP/s; humming usable: {humming_nvfp4.available()}", flush=True)
    torch.manual_seed(0)
    rows = []
    for model in args.models.split(","):
        for name, n, k in LAYERS[model]:
            if name not in args.layers.split(","):
                continue
            layer = f"{model} {name} {n}x{k}"
            nv_bytes = n * k // 2 + n * k // 16
            r_nv, r_bf = copies_for(nv_bytes, dev.L2_cache_size), copies_for(2 * n * k, dev.L2_cache_size)
            nv = [K.quantize((torch.randn(n, k, device="cuda") * 0.02).bfloat16()) for _ in range(max(r_nv, r_bf))]
            wbf = [codec.dequantize(*nv[i], dtype=torch.bfloat16) for i in range(r_bf)]
            nv = nv[:r_nv]
            shuf = [G.shuffle_weight(p, s) + (gs,) for p, s, gs in nv]
            hum = [NVFP4Gemm(*q, prefer="humming") for q in nv] if humming_nvfp4.available() else []
            ref_w = codec.dequantize(*nv[0], dtype=torch.float32)
            for m in [int(v) for v in args.m.split(",")]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ ref_w.T
                cols = dict(cublas=[lambda w=w: F.linear(x, w) for w in wbf],
                            triton=[lambda q=q: K.linear_forward(x, *q) for q in nv],
                            humming=[lambda g=g: g.forward(x, "humming") for g in hum] or None)
                errs = {}
                for cname, cfg in configs(n, k, m, args.configs).items():
                    try:
                        y = G.linear_forward(x, *shuf[0], config=cfg)
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                    except Exception as e:
                        print(f"  {layer} M={m} {cname}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        if cname == "default":
                            traceback.print_exc()
                        continue
                    errs[cname] = err
                    if err < 5e-3:
                        cols[f"gluon {cname}"] = [lambda s=s, c=cfg: G.linear_forward(x, *s, config=c) for s in shuf]
                    else:
                        print(f"  {layer} M={m} {cname}: WRONG, rel err {err:.2e}", flush=True)
                with torch.inference_mode():
                    t = interleaved_us(cols)
                gl_cols = {c: v for c, v in t.items() if c.startswith("gluon") and v == v}
                best = min(gl_cols, key=gl_cols.get) if gl_cols else None
                row = dict(layer=layer, M=m, cublas=t["cublas"], triton=t["triton"], humming=t.get("humming"),
                           gluon_default=t.get("gluon default", float("nan")), best=best,
                           gluon_best=gl_cols.get(best, float("nan")), errs=errs, all_us=t)
                row["x_cublas"] = row["cublas"] / row["gluon_best"]
                row["bw_share"] = (nv_bytes / (row["gluon_best"] * 1e-6)) / (bw * 1e12)
                rows.append(row)
                print("    " + "  ".join(f"{c[6:]} {v:.1f}" for c, v in sorted(gl_cols.items(), key=lambda cv: cv[1])))
                print(f"{layer:26s} M={m:3d} cuBLAS {row['cublas']:7.1f} triton {row['triton']:7.1f} humming "
                      f"{row['humming'] or float('nan'):7.1f} gluon {row['gluon_default']:7.1f} best "
                      f"{row['gluon_best']:7.1f} ({best}) x{row['x_cublas']:.2f} cuBLAS, {row['bw_share']:.0%} of copy",
                      flush=True)
            del nv, wbf, shuf, hum
            torch.cuda.empty_cache()
    md = [f"Device: {dev.name}; copy {bw:.2f} TB/s (read + write); µs per call, CUDA-graph replay, weights rotated "
          "past L2.", "", "| layer | M | cuBLAS bf16 | Triton | humming | Gluon default | Gluon best (config) | "
          "best vs cuBLAS | weight bytes / copy bandwidth |", "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['layer']} | {r['M']} | {r['cublas']:.1f} | {r['triton']:.1f} | "
           f"{(r['humming'] or float('nan')):.1f} | "
           f"{r['gluon_default']:.1f} | {r['gluon_best']:.1f} ({r['best']}) | {r['x_cublas']:.2f}× | "
           f"{r['bw_share']:.0%} |" for r in rows]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gluon_gemm.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.out, "gluon_gemm.json"), "w") as f:
        json.dump(dict(rows=rows, device=dev.name, copy_tbs=bw), f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    main()
