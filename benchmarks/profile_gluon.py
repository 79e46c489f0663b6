"""One Gluon decode GEMM call per configuration, for a profiler (ncu) to look at: 7B gate_up unless told.

    ncu --kernel-name regex:nvfp4_decode --launch-skip 1 --launch-count 1 --section WarpStateStats \
        python3 benchmarks/profile_gluon.py --m 1 --configs w1s8p2r128L

Each configuration runs twice (compile + warm-up, then the call the profiler skips to)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gluon_gemm import parse_spec  # noqa: E402
from qerl.kernels import gluon_nvfp4 as G  # noqa: E402
from qerl.kernels import nvfp4 as K  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=37888)
ap.add_argument("--k", type=int, default=3584)
ap.add_argument("--m", type=int, default=1)
ap.add_argument("--configs", default="w1s8p2r128L")
args = ap.parse_args()
q = K.quantize((torch.randn(args.n, args.k, device="cuda") * 0.02).bfloat16())
codes, scales = G.shuffle_weight(q[0], q[1])
x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
for spec in args.configs.split(","):
    cfg = G.default_config(args.n, args.k, args.m) if spec == "default" else parse_spec(spec)
    for _ in range(2):
        G.linear_forward(x, codes, scales, q[2], config=cfg)
    torch.cuda.synchronize()
    print(spec, "ok", flush=True)
