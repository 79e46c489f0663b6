"""Where an update first goes non-finite: bench_grpo_step's arm, one step, every module's output checked.

On 2026-12-02 (third session) every NVFP4 arm of `ragged_chain.sh 4` (7B shapes, gsm8k trace) had loss NaN from
the first update on (bf16 finite; the first rollout finite), so the LoRA weights went NaN and the second rollout
drew from NaN logits. This script runs one arm's first step with a forward hook on every module during the update
(never during the rollout: its CUDA graphs cannot sync) and a gradient hook on every module output, and prints the
first modules whose output, or whose output's gradient, holds a NaN or an inf, with the shapes and the GEMM
dispatch's choices around them.

    python benchmarks/find_nonfinite.py --arm nvfp4:gsm8k --arm nvfp4: --arm bf16:gsm8k  # each in its own process
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _desc(t) -> str:
    t = _tensor(t)
    if t is None:
        return "-"
    f = t.detach().float()
    fin = torch.isfinite(f)
    big = f[fin].abs().max().item() if fin.any() else float("nan")
    return f"{tuple(t.shape)} {t.dtype} nonfinite={int((~fin).sum())} max|finite|={big:.3g}"


def install(model: torch.nn.Module, found: list, limit: int = 8):
    """Hooks on every module of `model`, active while `on[0]`: the first `limit` non-finite outputs and grads."""
    names = {id(m): n or "<model>" for n, m in model.named_modules()}
    on = [False]
    calls = [0]

    def forward_hook(module, inputs, output):
        if not on[0]:
            return
        calls[0] += 1
        out = _tensor(output)
        if out is None or not out.is_floating_point():
            return
        name = names.get(id(module), type(module).__name__)
        if len(found) < limit and not bool(torch.isfinite(out).all()):
            found.append({"where": "forward", "module": name, "type": type(module).__name__, "call": calls[0],
                          "inputs": [_desc(i) for i in inputs[:2]], "output": _desc(out)})
            print("NONFINITE forward", found[-1], flush=True)
        if out.requires_grad:
            def grad_hook(g, name=name, call=calls[0]):
                if len(found) < limit and not bool(torch.isfinite(g).all()):
                    found.append({"where": "grad of output", "module": name, "call": call, "grad": _desc(g)})
                    print("NONFINITE grad", found[-1], flush=True)
            out.register_hook(grad_hook)

    handles = [m.register_forward_hook(forward_hook) for m in model.modules()]
    return on, handles


def one(spec: str, args) -> dict:
    import bench_grpo_step as bench
    from qerl.rl.trainer import Trainer

    scheme, _, rest = spec.partition(":")
    trace, _, sets = rest.partition(":")
    found: list = []
    real_update = Trainer.update
    state: dict = {}

    def update(self, batch):
        padded = batch.padded(0)
        mask = padded["mask"].bool()
        for key in ("rollout_logp",):
            t = padded.get(key)
            if isinstance(t, torch.Tensor):
                bad = ~torch.isfinite(t)
                print(f"batch {key}: {tuple(t.shape)} nonfinite {int(bad.sum())}, at loss tokens {int((bad & mask).sum())}"
                      f" (nan {int((torch.isnan(t) & mask).sum())}), loss tokens {int(mask.sum())}", flush=True)
                found.append({"where": f"batch.{key}", "nonfinite": int(bad.sum()),
                              "at_loss_tokens": int((bad & mask).sum()), "nan_at_loss_tokens":
                              int((torch.isnan(t) & mask).sum())})
        print("correction:", self.settings.grpo.correction, getattr(self, "correction", None), flush=True)
        if "on" not in state:
            state["on"], _ = install(self.model, found)
        state["on"][0] = True
        try:
            metrics = real_update(self, batch)
        finally:
            state["on"][0] = False
        print("update metrics:", {k: metrics.get(k) for k in ("loss", "grad_norm", "entropy")}, flush=True)
        return metrics

    Trainer.update = update
    r = bench.grpo_step(args.model, scheme, prompts=args.prompts, new=args.new if not trace else None,
                        steps=1, lengths=trace, acceptance=0.7 if trace else None, device=args.device,
                        micro=args.micro, overrides=tuple(filter(None, sets.split(","))))
    keep = ("scheme", "trace", "rows", "update_tokens", "loss_by_step", "grad_norm_by_step", "trainable_finite",
            "step_s")
    return {"arm": spec, **{k: r.get(k) for k in keep}, "found": found}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", default=[], help="SCHEME:TRACE[:KEY=VALUE,...] ('' trace: fixed lengths)")
    ap.add_argument("--model", default="7b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="outputs/nonfinite")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.one, args)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    for spec in args.arm:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", spec, "--model", args.model, "--prompts",
               str(args.prompts), "--new", str(args.new), "--micro", str(args.micro), "--device", args.device]
        p = subprocess.run(cmd, capture_output=True, text=True)
        log = p.stdout + p.stderr
        with open(os.path.join(args.out, f"nonfinite-{re.sub(r'[^A-Za-z0-9.-]+', '_', spec)}.log"), "w") as f:
            f.write(log)
        result = [line[7:] for line in log.splitlines() if line.startswith("RESULT ")]
        print(result[0] if result else f"{spec}: exit {p.returncode}\n" + log[-3000:], flush=True)


if __name__ == "__main__":
    main()
