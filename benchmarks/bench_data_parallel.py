"""GRPO step throughput over N GPUs vs 1, on the same total batch (data parallel as `qerl.rl.trainer` runs it).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 benchmarks/bench_data_parallel.py --model 7b --out DIR
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_data_parallel.py --model 7b --out DIR
    python3 benchmarks/bench_data_parallel.py --report DIR     # the table: N-GPU vs 1-GPU speed-up

Each rank takes its share of `--prompts` x `--group` rows (whole groups, as the trainer shards a step), rolls them out
on its own `RolloutEngine` with AQN noise, then runs the micro-batched DAPO update with the step's global token count
as normalizer and sums the LoRA gradients over ranks (`qerl.rl.distributed.Group.sum_gradients`, the trainer's call)
before the AdamW step. Step time is the slowest rank's; throughput is the step's total rows x new tokens per second.
One warm-up step (graph capture, allocator) is run first and not counted. NVLink multicast (NVLS) stays off.
Results: DIR/data_parallel.jsonl, one line per world size.
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
from bench_rollout import build_model, random_prompts  # noqa: E402
from qerl.model.aqn import NoiseInjector  # noqa: E402
from qerl.rl import grpo  # noqa: E402
from qerl.rl.distributed import process_group  # noqa: E402
from qerl.rollout.engine import RolloutEngine  # noqa: E402


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def run(args) -> None:
    with process_group(timeout_s=1800) as group:
        model = build_model(args.model, args.scheme)
        _, my_prompts = group.shard(random_prompts(args.prompts, args.prompt_len, model.config.vocab_size, seed=1))
        model.gradient_checkpointing = True
        params = [p for p in model.parameters() if p.requires_grad]
        group.broadcast(params)
        optimizer = torch.optim.AdamW(params, lr=1e-6)
        rows = len(my_prompts) * args.group
        engine, noise = RolloutEngine(model), NoiseInjector(model)
        engine.prepare(rows, args.prompt_len, args.new)
        cfg = grpo.LossConfig(loss_type="dapo")
        times = []
        for step in range(args.steps + 1):  # step 0 warms up
            group.barrier()
            t0 = sync_time()
            ps = [p for p in my_prompts for _ in range(args.group)]
            with noise.noisy(1e-2, seed=step):
                out = engine.generate(None, ps, args.new, temperature=1.0, eos_token_ids=[],
                                      seed=1000 * step + group.rank)
            t_rollout = sync_time() - t0
            dev = engine.device
            rewards = torch.rand(rows, generator=torch.Generator().manual_seed(step * 100 + group.rank))
            adv = grpo.group_advantages(rewards, args.group).to(dev)
            ids = torch.tensor([p + c for p, c in zip(out.prompt_ids, out.completion_ids)], device=dev)
            mask = torch.ones(rows, args.new, device=dev)
            (count,) = group.sum([float(mask.sum())])
            model.train()
            optimizer.zero_grad(set_to_none=True)
            for i in range(0, rows, args.micro):
                m = slice(i, i + args.micro)
                logits = model(ids[m], attention_mask=torch.ones_like(ids[m]), logits_to_keep=args.new + 1)
                logp = grpo.selective_log_softmax(logits[:, :-1].float(), ids[m, args.prompt_len:])
                loss, _ = grpo.policy_loss(logp, None, adv[m], mask[m], cfg, token_normalizer=count)
                loss.backward()
                del logits, logp, loss
            group.sum_gradients(params)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            model.eval()
            step_s, rollout_s = group.max([sync_time() - t0, t_rollout])
            if step:
                times.append((step_s, rollout_s))
        engine.free()
        if group.is_main:
            step_s = sum(t for t, _ in times) / len(times)
            r = {"model": args.model, "scheme": args.scheme, "gpus": group.world_size,
                 "rows": args.prompts * args.group, "new": args.new, "step_s": step_s,
                 "rollout_s": sum(r for _, r in times) / len(times),
                 "tok_s": args.prompts * args.group * args.new / step_s, "device": torch.cuda.get_device_name()}
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "data_parallel.jsonl"), "a") as log:
                log.write(json.dumps(r) + "\n")
            print(json.dumps(r), flush=True)


def report(folder: str) -> None:
    rows = [json.loads(x) for x in open(os.path.join(folder, "data_parallel.jsonl"))]
    one = {(r["model"], r["scheme"], r["rows"], r["new"]): r["tok_s"] for r in rows if r["gpus"] == 1}
    print("| model | base | GPUs | rows x new | step s | tok/s | speed-up vs 1 GPU |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = one.get((r["model"], r["scheme"], r["rows"], r["new"]))
        speedup = f"{r['tok_s'] / base:.2f}x" if base else "n/a"
        print(f"| {r['model']} | {r['scheme']} | {r['gpus']} | {r['rows']} x {r['new']} | {r['step_s']:.1f} | "
              f"{r['tok_s']:,.0f} | {speedup} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--scheme", default="nvfp4")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step over all GPUs")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    ap.add_argument("--out", default="outputs/bench")
    ap.add_argument("--report", default=None, help="print the table of a results folder and exit")
    args = ap.parse_args()
    if args.report:
        report(args.report)
    else:
        run(args)


if __name__ == "__main__":
    main()
