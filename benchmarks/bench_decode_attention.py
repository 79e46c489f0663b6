"""Decode attention (one query token per row against the KV cache) as the decode step runs it, swept over its launch.

    PYTHONPATH=. python3 benchmarks/bench_decode_attention.py --model 7b --rows 1,8,64 --windows 256,1024 \
        [--sweep] [--out DIR]

For each (rows, window): `qerl.execution.fused_ops.decode_attention` with the default launch, then (with --sweep) every
(target_programs, block_n, num_warps, num_stages) in the grid below, and the public kernels the image has: PyTorch's
`scaled_dot_product_attention` (GQA, additive mask) and flash-attn's `flash_attn_with_kvcache` when importable.
Each timed as a CUDA graph (median of 5 runs of 50 replays) on a cache laid out as the engine's
([rows, kv heads, slots, head_dim], window = the first slots), checked against SDPA first. The bound: K and V bytes
read once, against the device's copy bandwidth (measured here). Rows: DIR/decode_attention.jsonl; table on stdout.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_layer import graph_us  # noqa: E402
from qerl.execution import fused_ops  # noqa: E402

SHAPES = {"7b": (28, 4, 128), "32b": (40, 8, 128), "llama8b": (32, 8, 128)}  # heads, kv heads, head_dim
GRID = {"target_programs": (256, 528, 1056, 2112), "block_n": (32, 64, 128), "num_warps": (4, 8),
        "num_stages": (2, 3, 4)}


def copy_tb_s() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = graph_us(lambda: y.copy_(x))
    return 2 * x.numel() / us / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--windows", default="256,1024")
    ap.add_argument("--slots", type=int, default=1536, help="cache slots per row (>= every window)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--kv", default="model", help="model (bf16 caches) or fp8 (the FP8 layout, qerl.execution.kv8)")
    ap.add_argument("--grid", default="", help="override the sweep's grid: 'block_n=64,128;num_warps=4' ...")
    ap.add_argument("--out", default="outputs/bench_decode_attention")
    args = ap.parse_args()
    torch.manual_seed(0)
    heads, kv_heads, dim = SHAPES[args.model]
    for part in filter(None, args.grid.split(";")):
        key, _, values = part.partition("=")
        GRID[key] = tuple(int(v) for v in values.split(","))
    copy = copy_tb_s()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy:.2f} TB/s")
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:
        flash_attn_with_kvcache = None
    os.makedirs(args.out, exist_ok=True)
    out = open(os.path.join(args.out, "decode_attention.jsonl"), "a")
    print("| rows | window | arm | µs | KV TB/s (share of copy) |\n|---|---|---|---|---|")
    for rows, window in itertools.product(map(int, args.rows.split(",")), map(int, args.windows.split(","))):
        q = torch.randn(rows, heads * dim, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(rows, kv_heads, args.slots, dim, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        mask = torch.zeros(rows, window, device="cuda", dtype=torch.bfloat16)
        mask[:, window - 7:] = float("-inf")  # the slots not yet written, as the engine masks them
        kv_bytes = 2 * rows * kv_heads * window * dim * 2

        def sdpa():
            o = F.scaled_dot_product_attention(q.view(rows, heads, 1, dim), kc[:, :, :window], vc[:, :, :window],
                                               attn_mask=mask[:, None, None, :], enable_gqa=True)
            return o.reshape(rows, heads * dim)

        if args.kv == "fp8":  # the kernels read the packed caches; SDPA (the check, an arm) their unpacked values
            from qerl.execution import kv8

            kc, vc = kv8.pack(kc), kv8.pack(vc)
            kv_bytes = 2 * rows * kv_heads * window * kv8.packed_dim(dim)
            kf, vf = kv8.unpack(kc, torch.bfloat16), kv8.unpack(vc, torch.bfloat16)

            def sdpa():
                o = F.scaled_dot_product_attention(q.view(rows, heads, 1, dim), kf[:, :, :window], vf[:, :, :window],
                                                   attn_mask=mask[:, None, None, :], enable_gqa=True)
                return o.reshape(rows, heads * dim)

        want = sdpa().float()
        arms = [("qerl default", lambda: fused_ops.decode_attention(q, kc[:, :, :window], vc[:, :, :window], mask,
                                                                     heads, kv_heads, dim))]
        if args.sweep:
            for tp, bn, nw, ns in itertools.product(*GRID.values()):
                arms.append((f"qerl tp{tp} bn{bn} w{nw} s{ns}", lambda tp=tp, bn=bn, nw=nw, ns=ns:
                             fused_ops.decode_attention(q, kc[:, :, :window], vc[:, :, :window], mask, heads,
                                                        kv_heads, dim, target_programs=tp, block_n=bn, num_warps=nw,
                                                        num_stages=ns)))
        arms.append(("torch sdpa", sdpa))
        if flash_attn_with_kvcache is not None and args.kv == "model":
            kf, vf = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()  # its [rows, slots, Hkv, D]
            lens = torch.full((rows,), window - 7, dtype=torch.int32, device="cuda")
            arms.append(("flash-attn kvcache", lambda: flash_attn_with_kvcache(
                q.view(rows, 1, heads, dim), kf, vf, cache_seqlens=lens).reshape(rows, heads * dim)))
        best = None
        for name, fn in arms:
            try:
                err = (fn().float() - want).abs().max().item()
                if err > 2e-2:
                    print(f"| {rows} | {window} | {name} | wrong (max error {err:.3g}) | |")
                    continue
                us = graph_us(fn)
            except Exception as e:  # a launch that does not fit (shared memory, registers): say so and go on
                print(f"| {rows} | {window} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | |")
                continue
            tbs = kv_bytes / us / 1e6
            row = {"model": args.model, "kv": args.kv, "rows": rows, "window": window, "arm": name, "us": us,
                   "kv_tb_s": tbs,
                   "copy_tb_s": copy, "device": torch.cuda.get_device_name()}
            out.write(json.dumps(row) + "\n")
            if name.startswith("qerl tp") and (best is None or us < best[1]):
                best = (name, us, tbs)
            if not name.startswith("qerl tp"):
                print(f"| {rows} | {window} | {name} | {us:.1f} | {tbs:.2f} ({tbs / copy:.0%}) |")
        if best:
            print(f"| {rows} | {window} | best of sweep: {best[0]} | {best[1]:.1f} | {best[2]:.2f} "
                  f"({best[2] / copy:.0%}) |")
        out.flush()


if __name__ == "__main__":
    main()
