"""qerl's GRPO step beside what users would pick instead: TRL's `GRPOTrainer` + PEFT (and, on a GPU, its QLoRA form
and Unsloth), the same work, each arm in its own process on one machine.

    python benchmarks/bench_peers.py --device cpu --steps 4                  # the embedded default (SmolLM2-135M)
    python benchmarks/bench_peers.py --device cuda --model 7b --steps 2      # a random-weight 7B, 256 + 1,024 tokens

The same work in every arm: the same prompts (qerl's generated arithmetic questions in the model's chat template
with the params file's system prompt, or on the GPU a 256-token random-word prompt per question), 8 prompts x 8
samples, the same number of new tokens, LoRA r = 16 / alpha 32 on all seven linears, DAPO's loss (clip 0.2 / 0.28,
no KL), AdamW at the same learning rate, one optimizer step per 64 completions in micro-batches of 32 (CPU) or 4
(GPU), the same reward (qerl's accuracy on the CPU; a hash of the completion on the GPU, where random weights solve
nothing). Reported per arm: seconds per step (the median of the steps after the first, which pays one-offs), the
first step, CPU seconds per step (user + system, all threads), and peak memory (the process's resident set on the
CPU; the GPU's peak allocation on CUDA). The arms:

* `qerl-nvfp4`, `qerl-bf16` (fp32 on the CPU), `qerl-nf4-bnb` (CUDA): `qerl.trainer.Trainer`, as `qerl train` runs;
* `trl`: TRL's GRPOTrainer + PEFT LoRA on the plain model, generation through `transformers.generate`;
* `trl-qlora` (CUDA): the same on a bitsandbytes NF4 base (`BitsAndBytesConfig(load_in_4bit=True)`), as TRL's docs
  run QLoRA;
* `unsloth` (CUDA): Unsloth's `FastLanguageModel` + TRL's GRPOTrainer, as Unsloth's GRPO notebooks run it.

An arm that cannot run (a package missing, a GPU-only arm on the CPU) is reported with exactly why. Rows go to
OUT/peers.jsonl, and a markdown table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

CPU_ARMS = ("qerl-nvfp4", "qerl-bf16", "trl")
GPU_ARMS = ("qerl-nvfp4", "qerl-bf16", "qerl-nf4-bnb", "trl", "trl-qlora", "unsloth")
PROMPTS, GROUP, RANK = 8, 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Unavailable(Exception):
    """This arm cannot run here; the message says exactly why."""


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _peak_gib(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ------------------------------------------------------------------------------------------------ the shared work


def workload(args) -> dict:
    """What every arm trains on: settings overrides for qerl, and the prompts / reward / sizes for the peers."""
    if args.device == "cpu":
        return {"params": str(ROOT / "params" / "default.yaml"), "new": args.new or 24, "micro": 32,
                "lr": 3e-4, "reward": "accuracy"}
    return {"params": str(ROOT / "params" / "default.yaml"), "new": args.new or 1024, "micro": 4, "lr": 3e-4,
            "reward": "hash", "model": args.model, "prompt_len": 256}


def qerl_settings(w: dict, scheme: str, steps: int, extra: tuple[str, ...] = ()):
    from qerl.config import load_settings

    return load_settings(w["params"], overrides=[
        f"quant.scheme={scheme}", f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={GROUP}",
        f"rollout.max_new_tokens={w['new']}", "rollout.temperature=1.0", "grpo.loss_type=dapo", "grpo.beta=0.0",
        "grpo.epsilon_low=0.2", "grpo.epsilon_high=0.28", f"grpo.micro_batch_size={w['micro']}",
        f"lora.rank={RANK}", f"lora.alpha={2 * RANK}", f"optim.lr={w['lr']}", "optim.warmup_steps=0",
        f"train.steps={steps}", "train.eval_every=0", f"train.save_every={steps}", "tracking.backend=none", *extra])


def qerl_arm(args, scheme: str) -> dict:
    from qerl.trainer import Trainer

    w = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.device == "cpu":
            s = qerl_settings(w, scheme, args.steps)
            model = tokenizer = None
        else:
            import bench_grpo_step as g
            from bench_rollout import build_model

            model = build_model(args.model, scheme, lora_rank=0)
            tokenizer = g.numbered_tokenizer(model.config.vocab_size)
            s = qerl_settings(w, scheme, args.steps, (f"model.path=random-{args.model}",))
            s.lora.target_modules = TARGETS
            s.data.system_prompt = random_system_prompt(model.config.vocab_size, w["prompt_len"])
            s.train.rewards = {"bench_grpo_step:hash_reward": 1.0}
        times, cpu = [], []
        with Trainer(s, Path(tmp) / "run", model=model, tokenizer=tokenizer, progress=False) as trainer:
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), _cpu_seconds()
                trainer.train_step()
                times.append(time.perf_counter() - t0)
                cpu.append(_cpu_seconds() - c0)
            rows = trainer.metrics_log.read()
    last = rows[-1]
    return {"times": times, "cpu": cpu, "generate_s": last["seconds_rollout"], "update_s": last["seconds_update"],
            "reward_mean": [r["reward_mean"] for r in rows]}


def random_system_prompt(vocab: int, length: int) -> str:
    import random

    rng = random.Random(0)
    return " ".join(f"t{rng.randrange(vocab - 1)}" for _ in range(length - 8))


# ------------------------------------------------------------------------------------------------ TRL and Unsloth


def trl_arm(args, quantized: bool = False, unsloth: bool = False) -> dict:
    try:
        import trl
        from peft import LoraConfig
    except ImportError as e:
        raise Unavailable(f"{e.name} is not installed (pip install trl peft)") from None
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from qerl import data, rewards

    w = workload(args)
    s = qerl_settings(w, "bf16", args.steps)
    tmp = tempfile.mkdtemp()
    if args.device == "cpu":
        from qerl.loading import embedded_model_path
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = embedded_model_path()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        examples = data.examples_for(s.data)
        system = s.data.system_prompt
        score = rewards.get_reward_fn("accuracy")
    else:
        model, tokenizer, folder = peer_gpu_model(args, tmp, quantized, unsloth)
        examples = data.examples_for(s.data)
        system = random_system_prompt(tokenizer.vocab_size, w["prompt_len"])
        import bench_grpo_step as g

        score = g.hash_reward
    rows = [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": e.question}],
             "gold": e.gold} for e in examples]
    dataset = Dataset.from_list(rows * max(1, (PROMPTS * (args.steps + 1)) // len(rows) + 1))

    def reward(completions, gold, **_):
        return [float(score(c[0]["content"] if isinstance(c, list) else c, g)) for c, g in zip(completions, gold)]

    micro = w["micro"]
    config = trl.GRPOConfig(
        output_dir=tmp, max_steps=args.steps, learning_rate=w["lr"], lr_scheduler_type="constant",
        per_device_train_batch_size=micro, gradient_accumulation_steps=PROMPTS * GROUP // micro,
        num_generations=GROUP, max_completion_length=w["new"], temperature=1.0, loss_type="dapo", beta=0.0,
        epsilon=0.2, epsilon_high=0.28, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=args.device == "cpu", bf16=args.device == "cuda", gradient_checkpointing=args.device == "cuda",
        dataloader_num_workers=0)
    marks: list[tuple[float, float]] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            marks.append((time.perf_counter(), _cpu_seconds()))

        def on_step_end(self, *_, **__):
            marks.append((time.perf_counter(), _cpu_seconds()))

    peft_config = None if unsloth else LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                  task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config,
                              train_dataset=dataset, peft_config=peft_config, callbacks=[StepClock()])
    # TRL generates a step's completions before its first micro-batch, inside the step: the begin/end marks hold it.
    trainer.train()
    starts, ends = marks[0::2], marks[1::2]
    times = [e[0] - b[0] for b, e in zip(starts, ends)]
    cpu = [e[1] - b[1] for b, e in zip(starts, ends)]
    logged = [h for h in trainer.state.log_history if "reward" in h]
    return {"times": times, "cpu": cpu, "reward_mean": [h["reward"] for h in logged], "trl": trl.__version__}


def peer_gpu_model(args, tmp: str, quantized: bool, unsloth: bool):
    """The random-weight model of the published shape as the peers load it: a transformers folder on local disk."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import bench_grpo_step as g
    from bench_rollout import hf_config

    cfg = AutoConfig.for_model(**hf_config(args.model))
    folder = Path(tmp) / "model"
    torch.manual_seed(0)
    with torch.device("cuda"):
        dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    dense.save_pretrained(folder)
    tokenizer = g.numbered_tokenizer(cfg.vocab_size)
    tokenizer.save_pretrained(folder)
    del dense
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if unsloth:
        try:
            from unsloth import FastLanguageModel
        except ImportError as e:
            raise Unavailable(f"unsloth is not importable here ({e}); it needs unsloth_zoo, xformers and a "
                              "matching torch, which are not on this machine and cannot be downloaded here") from None
        model, tokenizer = FastLanguageModel.from_pretrained(str(folder), load_in_4bit=True, fast_inference=False,
                                                             max_lora_rank=RANK)
        model = FastLanguageModel.get_peft_model(model, r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                 use_gradient_checkpointing="unsloth")
        return model, tokenizer, folder
    kwargs = {}
    if quantized:
        try:
            from transformers import BitsAndBytesConfig
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise Unavailable(f"{e.name} is not installed (pip install bitsandbytes)") from None
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda", **kwargs)
    return model, tokenizer, folder


# ------------------------------------------------------------------------------------------------ one arm, all arms


def one_arm(args) -> int:
    arm = args.arm
    if args.device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
    try:
        if arm.startswith("qerl-"):
            r = qerl_arm(args, arm.removeprefix("qerl-"))
        elif arm in ("trl", "trl-qlora", "unsloth"):
            r = trl_arm(args, quantized=arm == "trl-qlora", unsloth=arm == "unsloth")
        else:
            raise Unavailable(f"unknown arm {arm!r}")
    except Unavailable as e:
        Path(args.row).write_text(json.dumps({"arm": arm, "unavailable": str(e)}))
        return 0
    steady = r["times"][1:] or r["times"]
    row = {"arm": arm, "device": args.device, "steps": len(r["times"]), "step_s": statistics.median(steady),
           "first_step_s": r["times"][0], "cpu_s_per_step": statistics.median(r["cpu"][1:] or r["cpu"]),
           "peak_gib": _peak_gib(args.device), **{k: v for k, v in r.items() if k not in ("times", "cpu")},
           "times": r["times"]}
    Path(args.row).write_text(json.dumps(row))
    return 0


def run_arm(arm: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--arm", arm, "--row", str(out), "--device", args.device,
               "--steps", str(args.steps), "--model", args.model] + (["--new", str(args.new)] if args.new else [])
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        if rc != 0 or not out.exists():
            return {"arm": arm, "unavailable": f"the arm's process failed (exit {rc}); its output is above"}
        row = json.loads(out.read_text())
        row["process_s"] = time.perf_counter() - t0
        return row


def table(rows: list[dict], device: str) -> str:
    base = next((r["step_s"] for r in rows if r["arm"] == "trl" and "step_s" in r), None)
    mem = next((r["peak_gib"] for r in rows if r["arm"] == "trl" and "peak_gib" in r), None)
    peak = "peak RSS GiB" if device == "cpu" else "peak GPU GiB"
    lines = [f"| arm | step s (median) | first step s | CPU s per step | {peak} | step vs TRL | memory vs TRL |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| {r['arm']} | not run: {r['unavailable']} | | | | | |")
            continue
        ratio = f"{r['step_s'] / base:.2f}x" if base else "-"
        mratio = f"{r['peak_gib'] / mem:.2f}x" if mem else "-"
        lines.append(f"| {r['arm']} | {r['step_s']:.2f} | {r['first_step_s']:.2f} | {r['cpu_s_per_step']:.2f} | "
                     f"{r['peak_gib']:.2f} | {ratio} | {mratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default="7b", help="GPU: the published shape (bench_rollout.hf_config)")
    ap.add_argument("--arms", default="", help="comma-separated; default: every arm for the device")
    ap.add_argument("--steps", type=int, default=4, help="steps per arm; the first pays one-offs")
    ap.add_argument("--new", type=int, default=0, help="new tokens per completion (default 24 CPU, 1,024 GPU)")
    ap.add_argument("--repeat", type=int, default=1, help="run the arm list this many times, interleaved")
    ap.add_argument("--out", default="outputs/peers")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        sys.exit(one_arm(args))
    arms = args.arms.split(",") if args.arms else list(CPU_ARMS if args.device == "cpu" else GPU_ARMS)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with open(Path(args.out) / "peers.jsonl", "a") as log:
        for _ in range(args.repeat):  # interleaved, so a change in the machine's load falls on every arm
            for arm in arms:
                row = run_arm(arm, args)
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(json.dumps({k: v for k, v in row.items() if k != "times"}), flush=True)
    print("\n" + table(rows, args.device))


if __name__ == "__main__":
    main()
