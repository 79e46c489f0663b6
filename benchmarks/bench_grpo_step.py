"""One full GRPO step on random-weight Qwen2.5 shapes: peak GPU memory and seconds per phase.

    PYTHONPATH=. python3 benchmarks/bench_grpo_step.py --models 7b,14b --schemes nvfp4,bf16,nf4-bnb --out DIR

The step, phase by phase as `qerl.trainer.Trainer` runs it (driven directly: no dataset or tokenizer needed):
rollout of 8 prompts x 8 samples (256-token prompts, exactly 1024 new tokens, temperature 1, AQN noise in the
norms) through the trainer's rollout seam (`qerl.rollout.EngineBackend`: sync, then generate); dummy rewards -> group advantages; then one DAPO update of the LoRA adapters
(r=16, all linears) with gradient checkpointing, micro-batched, `qerl.grpo.policy_loss` on
`selective_log_softmax` of the training forward, AdamW step. The engine's KV cache stays allocated through the
update (as in the trainer, so its graphs survive to the next step): the peak includes it. Graph capture is a
one-off per run and reported apart. Results: DIR/grpo_step.jsonl and a markdown table. The nf4-bnb arm is QLoRA
as its users run it (bitsandbytes NF4 + LoRA; needs `pip install -e ".[qlora]"`, else it is skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_rollout import SCHEMES, bnb_version, build_model, free_cuda, random_prompts  # noqa: E402
from qerl import grpo  # noqa: E402
from qerl.rollout import EngineBackend, Sampling  # noqa: E402

GIB = 2**30


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def grpo_step(name: str, scheme: str, prompts: int = 8, group: int = 8, prompt_len: int = 256, new: int = 1024,
              micro: int = 4, sigma: float = 1e-2, temperature: float = 1.0, steps: int = 2) -> dict:
    r: dict = {"model": name, "scheme": scheme, "rows": prompts * group, "prompt": prompt_len, "new": new,
               "micro_batch": micro}
    torch.cuda.reset_peak_memory_stats()
    t0 = sync_time()
    model = build_model(name, scheme)
    r["build_s"] = sync_time() - t0
    r["weights_gib"] = torch.cuda.memory_allocated() / GIB
    params = [p for p in model.parameters() if p.requires_grad]
    r["lora_params_m"] = sum(p.numel() for p in params) / 1e6
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    model.gradient_checkpointing = True
    rows = prompts * group
    backend = EngineBackend(model, None)
    engine = backend.engine

    t0 = sync_time()
    engine.prepare(rows, prompt_len, new)  # once per run: KV cache + decode graphs
    r["capture_s"] = sync_time() - t0
    r["kv_gib"] = engine.memory_bytes() / GIB

    def one_step() -> dict:
        r: dict = {}
        # Rollout (AQN noise written into the norm weights in place, removed afterwards).
        ps = [p for p in random_prompts(prompts, prompt_len, model.config.vocab_size, seed=1) for _ in range(group)]
        torch.cuda.reset_peak_memory_stats()
        t0 = sync_time()
        with backend.sync(sigma, noise_seed=1):
            out = backend.generate(ps, Sampling(max_new_tokens=new, temperature=temperature, eos_token_ids=(), seed=0))
        r["rollout_s"] = sync_time() - t0
        r["rollout_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        r["rollout_tok_s"] = rows * new / r["rollout_s"]

        # Scoring stand-in: random rewards, group-normalized advantages.
        rewards = torch.rand(rows, generator=torch.Generator().manual_seed(0))
        dev = engine.device
        adv = grpo.group_advantages(rewards, group).to(dev)

        # Update: micro-batched DAPO loss over the completion tokens, one optimizer step.
        torch.cuda.reset_peak_memory_stats()
        t0 = sync_time()
        ids = torch.tensor([p + c for p, c in zip(out.prompt_ids, out.completion_ids)], device=dev)
        attn = torch.ones_like(ids)
        mask = torch.ones(rows, new, device=dev)
        rollout_logp = torch.stack(out.logprobs).to(dev)
        cfg = grpo.LossConfig(loss_type="dapo")
        count = float(mask.sum())
        model.train()
        optimizer.zero_grad(set_to_none=True)
        gaps = []
        for i in range(0, rows, micro):
            m = slice(i, i + micro)
            logits = model(ids[m], attention_mask=attn[m], logits_to_keep=new + 1)[:, :-1].float() / temperature
            logp = grpo.selective_log_softmax(logits, ids[m, prompt_len:])
            loss, metrics = grpo.policy_loss(logp, None, adv[m], mask[m], cfg, rollout_logp=rollout_logp[m],
                                             token_normalizer=count)
            loss.backward()
            gaps.append(metrics["rollout_logp_gap/mean"])
            del logits, logp, loss
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        model.eval()
        r["update_s"] = sync_time() - t0
        r["update_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        r["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        r["update_tok_s"] = rows * (prompt_len + new) / r["update_s"]
        r["step_s"] = r["rollout_s"] + r["update_s"]
        r["peak_gib"] = max(r["rollout_peak_gib"], r["update_peak_gib"])
        r["gaps"] = gaps
        return r

    # Step 1 pays one-offs (each training shape's GEMM dispatch measurement, humming-kernels' JIT for new M
    # tiles, allocator growth); the steps after it are what a run of hundreds of steps sees. The last is reported.
    first = {}
    for _ in range(steps):
        last = one_step()
        first = first or last
    r.update(last)
    r["steps"] = steps
    r["first_step_s"] = first["step_s"]
    r["first_update_s"] = first["update_s"]
    gaps = last["gaps"]
    # |rollout log-prob - training log-prob|: engine vs training forward, plus the AQN noise the rollout saw.
    r["rollout_logp_gap"] = sum(gaps) / len(gaps)
    r.pop("gaps")
    r["sigma"] = sigma
    backend.free()
    del model, engine, backend, optimizer, params
    free_cuda()
    return r


def table(rows: list[dict]) -> str:
    lines = ["| model | base | weights GiB | KV GiB | capture s | rollout s (tok/s) | update s | step s (step 1) | "
             "peak GiB (rollout / update) | reserved GiB | logp gap | step speed vs bf16 / vs QLoRA |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    step = {(r["model"], r["scheme"]): r["step_s"] for r in rows}

    def speedup(r: dict, scheme: str) -> str:
        other = step.get((r["model"], scheme))
        return f"{other / r['step_s']:.2f}x" if other else "-"

    for r in rows:
        lines.append(f"| {r['model']} | {r['scheme']} | {r['weights_gib']:.1f} | {r['kv_gib']:.1f} | "
                     f"{r['capture_s']:.1f} | {r['rollout_s']:.1f} ({r['rollout_tok_s']:,.0f}) | {r['update_s']:.1f} | "
                     f"{r['step_s']:.1f} ({r['first_step_s']:.1f}) | {r['rollout_peak_gib']:.1f} / {r['update_peak_gib']:.1f} | "
                     f"{r['reserved_gib']:.1f} | {r['rollout_logp_gap']:.3f} | "
                     f"{speedup(r, 'bf16')} / {speedup(r, 'nf4-bnb')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b,14b")
    ap.add_argument("--schemes", default="nvfp4,bf16,nf4-bnb", help=f"any of {', '.join(SCHEMES)}")
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--sigma", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=2, help="steps per arm; the last is reported (step 1 pays one-offs)")
    ap.add_argument("--out", default="outputs/bench")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import kernels

    total = torch.cuda.get_device_properties(0).total_memory / GIB
    print(f"device {torch.cuda.get_device_name()} ({total:.0f} GiB) | NVFP4 Triton kernels "
          f"{'available' if kernels.available() else 'NOT available (PyTorch dequantize path)'} | "
          f"bitsandbytes {bnb_version()}", flush=True)
    rows = []
    with open(os.path.join(args.out, "grpo_step.jsonl"), "a") as log:
        for name in args.models.split(","):
            for scheme in args.schemes.split(","):
                try:
                    r = grpo_step(name, scheme, new=args.new, micro=args.micro, sigma=args.sigma, steps=args.steps)
                except ImportError as e:  # the QLoRA arm without bitsandbytes
                    print(f"[{name} {scheme}] skipped: {e}", flush=True)
                    continue
                except torch.OutOfMemoryError as e:
                    print(f"[{name} {scheme}] out of memory: {str(e).splitlines()[0]}", flush=True)
                    free_cuda()
                    continue
                except Exception as e:
                    print(f"[{name} {scheme}] FAILED {type(e).__name__}: {e}", flush=True)
                    free_cuda()
                    continue
                rows.append(r)
                log.write(json.dumps(r) + "\n")
                log.flush()
                print(f"[{name} {scheme}] " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in r.items()), flush=True)
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
