"""qerl's GRPO step beside what users would pick instead: TRL's `GRPOTrainer` + PEFT (and, on a GPU, its QLoRA form
and Unsloth), the same work, each arm in its own process on one machine.

    python benchmarks/bench_peers.py --device cpu --steps 2                  # the embedded default (SmolLM2-135M)
    python benchmarks/bench_peers.py --device cuda --model 7b --steps 2      # a random-weight 7B, 256 + 1,024 tokens
    python benchmarks/bench_peers.py --device cpu --tiny --arms all          # the GPU arms' code paths, tiny, on the CPU
    bash benchmarks/run_peers.sh OUTDIR                                      # the GPU run in one device call
    bash benchmarks/peers_chain.sh 1..4                                      # issue 49's vLLM arms, four calls

The same work in every arm: the same prompts (qerl's generated arithmetic questions in the model's chat template
with the params file's system prompt, or on the GPU a 256-token random-word prompt per question), 8 prompts x 8
samples (or `--rows` / 8 prompts), the same number of new tokens, LoRA r = 16 / alpha 32 on all seven linears, DAPO's
loss (clip 0.2 / 0.28, no KL), AdamW at the same learning rate, one optimizer step per step's completions in
micro-batches of 32 (CPU) or 4 (GPU), the same reward (qerl's accuracy on the CPU; a hash of the completion on the
GPU, where random weights solve nothing). Reported per arm: seconds per step (the median of the steps after the
first, which pays one-offs), the first step, CPU seconds per step (user + system, all threads), and peak memory
(the process's resident set on the CPU; the GPU's peak allocation on CUDA, and the device's, below). The arms:

* `qerl-nvfp4`, `qerl-bf16` (fp32 on the CPU), `qerl-nf4-bnb` (CUDA): `qerl.rl.trainer.Trainer`, as `qerl train` runs;
  `qerl-nvfp4-ckpt`: the same with `model.gradient_checkpointing=true` (every block recomputed, as TRL does; the
  default `auto` keeps what free memory holds, so its peak grows with the card); `qerl-nvfp4-fp8`: with
  `model.base_gemm=fp8` (the update's frozen-base GEMMs on FP8 tensor cores, opt-in);
* `trl`: TRL's GRPOTrainer + PEFT LoRA on the plain model, generation through `transformers.generate`;
* `trl-qlora` (CUDA): the same on a bitsandbytes NF4 base (`BitsAndBytesConfig(load_in_4bit=True)`), as TRL's docs
  run QLoRA;
* `unsloth` (CUDA): Unsloth's `FastLanguageModel` + TRL's GRPOTrainer, as Unsloth's GRPO notebooks run it;
* `trl-vllm`, `trl-vllm-qlora` (issue 49): the two TRL arms as TRL's GRPO users run them, generating with vLLM in the
  trainer's process (`use_vllm=True`, `vllm_mode="colocate"`, `vllm_enable_sleep_mode=True`: vLLM's weights and KV
  cache are handed back through the update; the LoRA is merged into the weights pushed to vLLM before each rollout);
* `unsloth-vllm-4bit`, `unsloth-vllm-16bit` (issue 49): Unsloth with `fast_inference=True` (vLLM sharing the weights
  with training, LoRA through vLLM's LoRA requests) and its standby mode (`UNSLOTH_VLLM_STANDBY=1`), on a 4-bit
  (bitsandbytes NF4) and a 16-bit base.

The vLLM arms load the random-weight model from a folder (vLLM reads a checkpoint), written once per run beside the
QLoRA and Unsloth arms' (PEERS_MODEL_DIR), and give vLLM `--vllm-memory` of the GPU (default 0.3, TRL's GRPOConfig
default: 42 of the H200's 141 GB, room for the 7B's bf16 weights, a KV cache for 128 rows x 1,280 tokens (9.4 GB)
and vLLM's graphs beside the trainer; the same for the Unsloth arms, whose own default is 0.5). Their generation
time is TRL's `_generate` as the other TRL arms' (with vLLM it includes waking vLLM, pushing the merged weights
(also given apart as `sync_s`), and putting it back to sleep); the rest of the step is the update (with it TRL's
forward over the completions for the log-probs its importance-sampling correction of vLLM's sampling needs, on by
default with vLLM, as its users run it). Their peak memory cannot be read off PyTorch's allocator (vLLM allocates
its weights and KV cache through its own memory pool): every CUDA arm also reports `device_peak_gib`, the most GPU
memory the arm held (as nvidia-smi counts it, CUDA context included), sampled through NVML every 20 ms, the figure
the table compares on CUDA.

`--arms` takes `ARM@ROWS` (e.g. `trl-vllm@128`): that arm at 8 samples of ROWS / 8 prompts per step (default
`--rows`, 64); the table holds one line per arm and row count, each compared with the same row count's TRL and qerl
NVFP4 lines. `--table FILE...` prints the table of rows from earlier runs (each device call writes its own
peers.jsonl).

An arm that cannot run (a package missing, a GPU-only arm on the CPU, an exception, its time limit) is reported as
"did not run: <exactly why>", with how far it got (rows hold `reached`: model loaded, steps done). `--arm-steps
trl=1` gives an arm its own number of steps (on the GPU a TRL step is ~100 s: one step, which then also pays its
one-offs, small there: no graph capture or compilation); `--budget-s` caps the whole run (each arm's limit is what
is left), so one device call always ends with its rows written. Rows go to OUT/peers.jsonl (appended), and a
markdown table is printed last.

`--tiny` runs the GPU work (random weights of the 7B's architecture at tiny sizes, the word-level tokenizer over the
vocabulary, the 256-token-style random system prompt, the hash reward, micro-batches of 4, gradient checkpointing)
on whatever `--device` says: on the CPU it is the dry run of every GPU arm's code path short of CUDA itself.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every arm waits on OpenMP passively, as qerl's commands set it for themselves (qerl.cli.prepare_process): an arm
# that imports torch first (TRL's) would otherwise spin its OpenMP threads, which on a machine shared with other work
# turns waiting into CPU seconds (TRL's CPU step on a load of 3-7: 221 s spinning, 80 s passive; BENCHMARKS.md
# "Beside TRL on the CPU").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from device_peak import DevicePeak  # noqa: E402 -- this folder is on the path from here

CPU_ARMS = ("qerl-nvfp4", "qerl-bf16", "trl")
VLLM_ARMS = ("trl-vllm", "trl-vllm-qlora", "unsloth-vllm-4bit", "unsloth-vllm-16bit")
GPU_ARMS = ("qerl-nvfp4", "qerl-nvfp4-ckpt", "qerl-nvfp4-fp8", "qerl-bf16", "qerl-nf4-bnb", "trl", "trl-qlora",
            "unsloth", *VLLM_ARMS)
PEER_ARMS = ("trl", "trl-qlora", "unsloth", *VLLM_ARMS)
QERL_SETTINGS = {"-ckpt": "model.gradient_checkpointing=true", "-fp8": "model.base_gemm=fp8"}
PROMPTS_DEFAULT, GROUP, RANK = 8, 8, 16
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


def _reached(args, **kv) -> None:
    """How far the arm got, written as it goes: a run killed at its limit still says where it was."""
    if not args.row:
        return
    path = Path(args.row)
    row = json.loads(path.read_text()) if path.exists() else {"arm": args.arm}
    row.setdefault("reached", {}).update(kv)
    path.write_text(json.dumps(row))


def gpu_work(args) -> bool:
    """The GPU's workload (random 7B-shaped weights, 256 + 1,024 tokens), on CUDA or, with --tiny, at tiny size."""
    return args.device == "cuda" or args.tiny


# ------------------------------------------------------------------------------------------------ the shared work


def workload(args) -> dict:
    """What every arm trains on: settings overrides for qerl, and the prompts / reward / sizes for the peers."""
    prompts = args.rows // GROUP  # GROUP samples of each prompt: one optimizer step per `rows` completions
    if not gpu_work(args):
        return {"params": str(ROOT / "params" / "default.yaml"), "new": args.new or 24, "micro": 32,
                "lr": 3e-4, "reward": "accuracy", "prompts": prompts}
    return {"params": str(ROOT / "params" / "default.yaml"), "new": args.new or (16 if args.tiny else 1024),
            "micro": 4, "lr": 3e-4, "reward": "hash", "model": args.model, "prompt_len": 32 if args.tiny else 256,
            "prompts": prompts}


def qerl_settings(w: dict, scheme: str, steps: int, extra: tuple[str, ...] = ()):
    from qerl.config import load_settings

    return load_settings(w["params"], overrides=[
        f"quant.scheme={scheme}", f"rollout.prompts_per_step={w['prompts']}", f"rollout.group_size={GROUP}",
        f"rollout.max_new_tokens={w['new']}", "rollout.temperature=1.0", "grpo.loss_type=dapo", "grpo.beta=0.0",
        "grpo.epsilon_low=0.2", "grpo.epsilon_high=0.28", f"grpo.micro_batch_size={w['micro']}",
        f"lora.rank={RANK}", f"lora.alpha={2 * RANK}", f"optim.lr={w['lr']}", "optim.warmup_steps=0",
        # One step more than the arm runs: no checkpoint is written inside a timed step (TRL's arms save nothing).
        f"train.steps={steps + 1}", "train.eval_every=0", f"train.save_every={steps + 1}", "tracking.backend=none",
        *extra])


def qerl_arm(args, scheme: str, extra: tuple[str, ...] = ()) -> dict:
    from qerl.rl.trainer import Trainer

    w = workload(args)
    steps = arm_steps(args)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if not gpu_work(args):
            s = qerl_settings(w, scheme, steps, extra)
            model = tokenizer = None
        else:
            import bench_grpo_step as g
            from bench_rollout import build_model

            # As bench_grpo_step builds it: the published shape, the base in `scheme`, q/k/v and gate/up fused on
            # CUDA (as load_base_model leaves them there); the trainer applies LoRA.
            model = build_model(args.model, scheme, lora_rank=0, device=args.device, fuse=args.device == "cuda")
            tokenizer = g.numbered_tokenizer(model.config.vocab_size)
            s = qerl_settings(w, scheme, steps, (f"model.path=random-{args.model}", *extra))
            s.lora.target_modules = TARGETS
            s.data.system_prompt = random_system_prompt(model.config.vocab_size, w["prompt_len"])
            s.train.rewards = {"bench_grpo_step:hash_reward": 1.0}
        _reached(args, model_loaded_s=round(time.perf_counter() - t0, 1))
        load_peak = _peak_gib(args.device)  # the trainer's steps measure their own peaks from here
        times, cpu = [], []
        with Trainer(s, Path(tmp) / "run", model=model, tokenizer=tokenizer, progress=False) as trainer:
            for _ in range(steps):
                t0, c0 = time.perf_counter(), _cpu_seconds()
                trainer.train_step()
                times.append(time.perf_counter() - t0)
                cpu.append(_cpu_seconds() - c0)
                _reached(args, steps_done=len(times), step_s=[round(t, 2) for t in times])
            rows = trainer.run.metrics.read()
    last = rows[-1]
    r = {"times": times, "cpu": cpu, "generate_s": last["seconds_rollout"], "update_s": last["seconds_update"],
         "reward_mean": [r["reward_mean"] for r in rows],
         # The update's memory plan (model.gradient_checkpointing / keep_dequantized: auto), which sets its speed
         # and its peak: the blocks recomputed and the dequantized weights kept, per step.
         "recomputed_blocks": [r.get("recomputed_blocks") for r in rows],
         "held_weights_gib": [r.get("held_weights_gib") for r in rows]}
    if args.device == "cuda":
        # The trainer's own figure: PyTorch's allocations plus the engine's KV cache, which lives outside PyTorch's
        # allocator (mapped during rollouts, handed back for updates), so max_memory_allocated alone would miss it.
        r["peak_gib"] = max([load_peak] + [row["peak_memory_gb"] for row in rows])
        r["peak_rollout_update_gib"] = [row["peak_memory_gb"] for row in rows]
    return r


def arm_steps(args) -> int:
    """--steps, or the arm's own number from --arm-steps (e.g. trl=1,trl-qlora=1)."""
    for part in filter(None, (args.arm_steps or "").split(",")):
        name, _, n = part.partition("=")
        if name.strip() == args.arm:
            return int(n)
    return args.steps


def random_system_prompt(vocab: int, length: int) -> str:
    import random

    rng = random.Random(0)
    return " ".join(f"t{rng.randrange(vocab - 1)}" for _ in range(length - 8))


# ------------------------------------------------------------------------------------------------ TRL and Unsloth


def vllm_unavailable(args) -> str:
    """Why a vLLM arm cannot run here ("" when it can): vLLM missing, or no CUDA device (vLLM has no CPU path in the
    staged build; the --tiny dry run on the CPU stops here, after everything before vLLM ran)."""
    import importlib.util

    # Unsloth probes vLLM as it is imported and, if vLLM's compiled parts do not load (or refuse this transformers),
    # hides it (find_spec then says None): its own reason is the one to report.
    unsloth_says = getattr(sys.modules.get("unsloth.import_fixes"), "VLLM_DISABLED_REASON", None)
    if unsloth_says:
        return first_line(unsloth_says)
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (on a GPU machine: benchmarks/stage_vllm.sh pack peers, then receive)"
    if args.device != "cuda":
        return f"vLLM's engine needs a CUDA device (--device {args.device})"
    return ""


def import_unsloth(standby: bool) -> None:
    """Unsloth patches transformers, PEFT and TRL as it is imported: first, as its notebooks do, and before CUDA
    starts (it sets the allocator's configuration: expandable segments, or with standby none, which vLLM's sleep-mode
    pool requires)."""
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # it would fetch a README from the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if standby:
        # vLLM's weights are the training weights and its KV cache is handed back through the update, as Unsloth's
        # GRPO guide runs fast_inference; read at import, so set before it.
        os.environ.setdefault("UNSLOTH_VLLM_STANDBY", "1")
    try:
        import unsloth  # noqa: F401
        from unsloth import FastLanguageModel  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"unsloth is not importable here: {type(e).__name__}: {first_line(e)}") from None


def trl_arm(args, quantized: bool = False, unsloth: bool = False, vllm: bool = False) -> dict:
    if unsloth:
        import_unsloth(standby=vllm)
    try:
        import trl
        from peft import LoraConfig
    except ImportError as e:
        if e.name in ("trl", "peft"):
            raise Unavailable(f"{e.name} is not installed (pip install trl peft)") from None
        # Installed, but something under it does not import here (a staged package built for another Python, say)
        raise Unavailable(f"trl or peft does not import here: {type(e).__name__}: {first_line(e)}") from None
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from qerl.data import problems as data
    from qerl.data import rewards

    w = workload(args)
    steps = arm_steps(args)
    s = qerl_settings(w, "bf16", steps)
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    if not gpu_work(args):
        from qerl.model.loading import embedded_model_path
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = embedded_model_path()
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)  # as qerl: no model folder's code
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False)
        examples = data.examples_for(s.data)
        system = s.data.system_prompt
        score = rewards.get_reward_fn("accuracy")
    else:
        model, tokenizer = peer_model(args, tmp, quantized, unsloth, vllm)
        examples = data.examples_for(s.data)
        from bench_rollout import hf_config

        system = random_system_prompt(hf_config(args.model)["vocab_size"], w["prompt_len"])  # qerl's arms' prompt
        import bench_grpo_step as g

        score = g.hash_reward
    _reached(args, model_loaded_s=round(time.perf_counter() - t0, 1))
    rows = [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": e.question}],
             "gold": e.gold} for e in examples]
    dataset = Dataset.from_list(rows * max(1, (w["prompts"] * (steps + 1)) // len(rows) + 1))

    def reward(completions, gold, **_):
        return [float(score(c[0]["content"] if isinstance(c, list) else c, g)) for c, g in zip(completions, gold)]

    micro = w["micro"]
    config = trl.GRPOConfig(
        output_dir=tmp, max_steps=steps, learning_rate=w["lr"], lr_scheduler_type="constant",
        per_device_train_batch_size=micro, gradient_accumulation_steps=w["prompts"] * GROUP // micro,
        num_generations=GROUP, max_completion_length=w["new"], temperature=1.0, loss_type="dapo", beta=0.0,
        epsilon=0.2, epsilon_high=0.28, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        # Truncated completions stay in the loss, as in qerl's arm (grpo.mask_truncated: false) and TRL's default.
        # Said explicitly for Unsloth, which turns it on when left unset with loss_type dapo; EOS never ends a
        # completion here, so that zeroed its loss (and gradient) and took each completion out of the update's
        # attention mask, which may change its work too (its rows of 2026-11-28).
        mask_truncated_completions=False,
        use_cpu=args.device == "cpu", bf16=args.device == "cuda", dataloader_num_workers=0,
        # Unsloth's notebooks leave it off here: get_peft_model(use_gradient_checkpointing="unsloth") set its own.
        gradient_checkpointing=gpu_work(args) and not unsloth,
        # TRL's colocated vLLM as its docs run it; Unsloth turns use_vllm on itself for a fast_inference model.
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                vllm_gpu_memory_utilization=args.vllm_memory, vllm_max_model_length=w_len(args))
           if vllm and not unsloth else {}))
    marks: list[tuple[float, float]] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            marks.append((time.perf_counter(), _cpu_seconds()))

        def on_step_end(self, *_, **__):
            marks.append((time.perf_counter(), _cpu_seconds()))
            n = len(marks) // 2
            _reached(args, steps_done=n, step_s=[round(e[0] - b[0], 2) for b, e in zip(marks[0::2], marks[1::2])])

    peft_config = None if unsloth else LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                  task_type="CAUSAL_LM")
    if vllm and not unsloth and (why := vllm_unavailable(args)):
        raise Unavailable(why)  # TRL would start vLLM in its constructor
    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config,
                              train_dataset=dataset, peft_config=peft_config, callbacks=[StepClock()])
    # The rollout's share of a step: TRL generates a step's completions before its first micro-batch, inside the
    # step (the begin/end marks hold it), in `_generate` (prompt tokenization, `generate`, decoding).
    generate_s: list[float] = []
    inner = getattr(trainer, "_generate", None)  # TRL 1.15 and 1.16 have it; a trainer without it: no split

    def timed_generate(*a, **k):
        g0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            if args.device == "cuda":
                torch.cuda.synchronize()
            generate_s.append(time.perf_counter() - g0)

    if inner is not None:
        trainer._generate = timed_generate
    # TRL's colocated vLLM: the merged weights pushed into vLLM before each rollout (inside `_generate`), given apart.
    sync_s: list[float] = []
    engine = getattr(trainer, "vllm_generation", None)
    if engine is not None and hasattr(engine, "sync_weights"):
        sync = engine.sync_weights

        def timed_sync(*a, **k):
            s0 = time.perf_counter()
            try:
                return sync(*a, **k)
            finally:
                torch.cuda.synchronize()
                sync_s.append(time.perf_counter() - s0)

        engine.sync_weights = timed_sync
    _reached(args, trainer_ready_s=round(time.perf_counter() - t0, 1))
    trainer.train()
    starts, ends = marks[0::2], marks[1::2]
    times = [e[0] - b[0] for b, e in zip(starts, ends)]
    cpu = [e[1] - b[1] for b, e in zip(starts, ends)]
    logged = [h for h in trainer.state.log_history if "reward" in h]
    r = {"times": times, "cpu": cpu, "reward_mean": [h["reward"] for h in logged], "trl": trl.__version__,
         "versions": package_versions("torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "vllm",
                                      "unsloth", "unsloth_zoo"),
         # The work as the trainer ran it (Unsloth rewrites TRL's config: this shows it kept the same batch).
         "work": {k: getattr(trainer.args, k, None) for k in (
             "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
             "num_generations", "max_completion_length", "loss_type", "beta", "gradient_checkpointing", "use_vllm",
             "vllm_mode", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "mask_truncated_completions")}}
    if sync_s:
        r["sync_s"] = sync_s[-1]
    if generate_s:
        r["generate_s"] = generate_s[-1]
        r["update_s"] = times[-1] - generate_s[-1]  # the rest of the step: scoring, the update, the optimizer
    return r


def random_peer(args, distinct_pad: bool):
    """The random-weight model of the published shape (a function building it on the device) and its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import bench_grpo_step as g
    from bench_rollout import hf_config

    shape = hf_config(args.model)
    vocab = shape["vocab_size"]
    end = vocab - 1  # numbered_tokenizer's end-of-sequence token
    # Padding is the end token, except for Unsloth: its fix_pad_token refuses a pad equal to EOS (it would add a new
    # token past the embedding and stop), so its arm pads with a token of its own. Every completion is full length
    # and prompts are left-padded under the attention mask, so the pad id changes no work.
    pad = end - 1 if distinct_pad else end
    tokenizer = g.numbered_tokenizer(vocab, distinct_pad=distinct_pad)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    def build():
        cfg = AutoConfig.for_model(**shape, eos_token_id=end, pad_token_id=pad, bos_token_id=None)
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(args.device):
                dense = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        finally:
            torch.set_default_dtype(previous)
        dense.generation_config.eos_token_id = end
        dense.generation_config.pad_token_id = pad
        return dense

    return build, tokenizer


def peer_checkpoint(args, tmp: str, distinct_pad: bool) -> Path:
    """The random model saved as a Hugging Face folder, once per run (PEERS_MODEL_DIR, set by run_peers.sh and
    peers_chain.sh): the QLoRA, Unsloth and vLLM arms load the same files, and the second skips the build and the
    15 GB write."""
    name = f"random-{args.model}-seed0{'-pad' if distinct_pad else ''}"
    folder = Path(os.environ.get("PEERS_MODEL_DIR") or tmp) / name
    if not (folder / "saved.ok").exists():
        build, tokenizer = random_peer(args, distinct_pad)
        dense = build()
        dense.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "saved.ok").write_text("complete\n")
        del dense
    return folder


def peer_model(args, tmp: str, quantized: bool, unsloth: bool, vllm: bool = False):
    """The random-weight model of the published shape as the peers load it. bf16 (TRL + PEFT): built on the device,
    the same weights `from_pretrained` would give. QLoRA and Unsloth quantize while they load a checkpoint, and vLLM
    loads one, so for them the model is saved to local disk first and loaded from there as their users load one."""
    import torch
    from transformers import AutoModelForCausalLM

    # The vLLM arms share Unsloth's folder (one 15 GB write per machine).
    distinct_pad = unsloth or vllm
    build, tokenizer = random_peer(args, distinct_pad)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if not quantized and not unsloth and not vllm:
        return build(), tokenizer
    folder = peer_checkpoint(args, tmp, distinct_pad)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the peak is the quantized model's run, not the dense build before it
    if unsloth:
        from unsloth import FastLanguageModel

        # As Unsloth's GRPO notebooks load a model without vLLM: 4-bit (bitsandbytes NF4), LoRA on all linears,
        # Unsloth's gradient checkpointing. The tokenizer is the stand-in object itself: read back from the folder,
        # transformers 5 makes any model_type qwen2 tokenizer its byte-level BPE class (Qwen2Tokenizer), which turns
        # the word-level vocabulary's prompts into no tokens at all (and Unsloth's check_tokenizer would then find
        # its added specials past the embedding) -- so fix_tokenizer=False and the loaded one is set aside.
        # With fast_inference (vLLM, issue 49): 4-bit or 16-bit, vLLM given the same share of the GPU as TRL's.
        if vllm and (why := vllm_unavailable(args)):
            raise Unavailable(why)
        fast = dict(fast_inference=True, gpu_memory_utilization=args.vllm_memory, load_in_16bit=not quantized) \
            if vllm else dict(fast_inference=False)
        model, _ = FastLanguageModel.from_pretrained(
            str(folder), max_seq_length=w_len(args), load_in_4bit=quantized and args.device == "cuda", **fast,
            max_lora_rank=RANK, dtype=dtype, use_exact_model_name=True,  # a local folder: no hub name mapping
            fix_tokenizer=False, trust_remote_code=False)
        model = FastLanguageModel.get_peft_model(model, r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                 use_gradient_checkpointing="unsloth", random_state=0)
        return model, tokenizer
    if not quantized:  # TRL + vLLM on the bf16 base: the trainer's model is the folder vLLM loads (its name_or_path)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=args.device,
                                                     trust_remote_code=False)
        return model, tokenizer
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as e:
        raise Unavailable(f"{e.name} is not installed (pip install bitsandbytes)") from None
    # As TRL's docs run QLoRA: NF4 with bf16 compute (TRL then prepares the model for k-bit training).
    qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=args.device,
                                                 quantization_config=qconfig, trust_remote_code=False)
    return model, tokenizer


def w_len(args) -> int:
    w = workload(args)
    return w["prompt_len"] + 32 + w["new"]  # the system prompt, the question and the template's words, the answer


def package_versions(*names: str) -> dict:
    """The versions this process imports (the GPU's image, the staged folders): each row says what it ran."""
    import importlib.metadata as md

    found = {}
    for name in names:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return found


def first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:400] if text else ""


# ------------------------------------------------------------------------------------------------ one arm, all arms


def one_arm(args) -> int:
    arm = args.arm
    device_peak = DevicePeak.begin("bench_peers") if args.device == "cuda" else None  # before the arm's CUDA context
    try:
        if arm.startswith("unsloth") and (args.device == "cuda" or args.tiny):
            import_unsloth(standby=arm in VLLM_ARMS)
        if args.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
        if arm.startswith("qerl-"):
            scheme, extra = qerl_arm_settings(arm)
            if scheme == "nf4-bnb" and args.device != "cuda":
                raise Unavailable("bitsandbytes' NF4 base is a CUDA arm")
            r = qerl_arm(args, scheme, extra)
        elif arm in PEER_ARMS:
            if arm.startswith("unsloth") and args.device != "cuda" and not args.tiny:
                raise Unavailable("Unsloth's GRPO path needs a GPU")
            if arm in VLLM_ARMS and args.device != "cuda" and not args.tiny:
                raise Unavailable("a vLLM arm needs a GPU (or --tiny for its dry run up to vLLM)")
            # Unsloth's arm without vLLM is 4-bit (as its notebooks); its vLLM arms say which.
            r = trl_arm(args, quantized=arm in ("trl-qlora", "trl-vllm-qlora", "unsloth", "unsloth-vllm-4bit"),
                        unsloth=arm.startswith("unsloth"), vllm=arm in VLLM_ARMS)
        else:
            raise Unavailable(f"unknown arm {arm!r}")
    except Unavailable as e:
        _write_row(args, {"arm": arm, "rows": args.rows, "unavailable": str(e)})
        return 0
    except Exception as e:  # noqa: BLE001 -- the row says why, the traceback goes to the log
        import traceback

        traceback.print_exc()
        _write_row(args, {"arm": arm, "rows": args.rows, "unavailable": f"{type(e).__name__}: {first_line(e)}"})
        return 0
    steady = r["times"][1:] or r["times"]
    row = {"arm": arm, "rows": args.rows, "device": args.device, "steps": len(r["times"]),
           "step_s": statistics.median(steady),
           "first_step_s": r["times"][0], "cpu_s_per_step": statistics.median(r["cpu"][1:] or r["cpu"]),
           "peak_gib": r.get("peak_gib", _peak_gib(args.device)),
           **{k: v for k, v in r.items() if k not in ("times", "cpu", "peak_gib")},
           "times": r["times"]}
    if args.device == "cuda":
        import torch

        row["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if device_peak is not None:
            row["device_peak_gib"] = device_peak.stop()
    _write_row(args, row)
    return 0


def _write_row(args, row: dict) -> None:
    """The arm's final row, keeping how far it got (`reached`)."""
    path = Path(args.row)
    if path.exists():
        row = {"reached": json.loads(path.read_text()).get("reached", {}), **row}
    path.write_text(json.dumps(row))


def parse_arms(spec: str, every: tuple[str, ...], rows: int) -> list[tuple[str, int]]:
    """`--arms`: comma-separated ARM or ARM@ROWS ('' or 'all': every arm of `every`) as (arm, rows) pairs. Raises
    ValueError naming the first entry that is not an arm or whose rows are not a positive multiple of the group."""
    if spec in ("", "all"):
        return [(arm, rows) for arm in every]
    pairs = []
    for entry in spec.split(","):
        arm, _, n = entry.strip().partition("@")
        if arm not in GPU_ARMS + CPU_ARMS:
            raise ValueError(f"--arms: unknown arm {arm!r} in {entry!r} (arms: {', '.join(GPU_ARMS)})")
        if n and not (n.isdigit() and int(n) > 0 and int(n) % GROUP == 0):
            raise ValueError(f"--arms: rows in {entry!r} must be a positive multiple of the group size {GROUP}")
        pairs.append((arm, int(n) if n else rows))
    return pairs


def qerl_arm_settings(arm: str) -> tuple[str, tuple[str, ...]]:
    """qerl-<scheme>, or qerl-<scheme>-<setting>, as the quantization scheme and the `-S` overrides the arm runs:
    -ckpt, every block recomputed in the update, as TRL's gradient checkpointing does (the default, `auto`, keeps
    what the free memory holds: faster, higher peak); -fp8, the update's frozen-base GEMMs in FP8 (model.base_gemm,
    opt-in)."""
    scheme = arm.removeprefix("qerl-")
    for suffix, setting in QERL_SETTINGS.items():
        if scheme.endswith(suffix):
            return scheme.removesuffix(suffix), (setting,)
    return scheme, ()


def run_arm(arm: str, rows: int, args, limit: float) -> dict:
    """One arm in its own process (its peak memory and one-offs are its own), killed with its children at `limit`
    seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--arm", arm, "--row", str(out), "--device", args.device,
               "--steps", str(args.steps), "--arm-steps", args.arm_steps, "--model", args.model,
               "--rows", str(rows), "--vllm-memory", str(args.vllm_memory)]
        cmd += (["--new", str(args.new)] if args.new else []) + (["--tiny"] if args.tiny else [])
        env = dict(os.environ)
        if arm.startswith("unsloth") and args.unsloth_site:
            # Unsloth pins older TRL and datasets (trl<=1.15, datasets<5): its own site goes first for its arm only.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.unsloth_site, env.get("PYTHONPATH", "")]))
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=None if limit == float("inf") else max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        seconds = time.perf_counter() - t0
        row = json.loads(out.read_text()) if out.exists() else {"arm": arm}
        if rc is None:
            row = {"arm": arm, "rows": rows, "reached": row.get("reached", {}),
                   "unavailable": f"did not finish within its limit of {limit:.0f} s (killed)"}
        elif rc != 0 or ("step_s" not in row and "unavailable" not in row):
            row = {"arm": arm, "rows": rows, "reached": row.get("reached", {}),
                   "unavailable": f"the arm's process failed (exit {rc}); its output is above"}
        row["process_s"] = seconds
        return row


def table(rows: list[dict], device: str) -> str:
    """One line per arm and row count. On CUDA, memory is compared on the device's peak where both lines have it
    (the vLLM arms' only honest figure), else on the arm's own peak; the TRL line compared with is TRL + vLLM where
    the run has it at that row count, else TRL with `generate`."""
    def first(arm, n, key):
        return next((r[key] for r in rows if r["arm"] == arm and r.get("rows", 64) == n and key in r), None)

    peak = "peak RSS GiB" if device == "cpu" else "peak GPU GiB"
    lines = [f"| arm | rows | step s | generate s | update s | first step s | CPU s per step | {peak} | "
             "device peak GiB | step vs TRL | memory vs TRL | qerl NVFP4 faster by |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        n = r.get("rows", 64)  # rows of runs before issue 49 are 64
        if "unavailable" in r:
            got = r.get("reached") or {}
            far = f" (reached: {', '.join(f'{k} {v}' for k, v in got.items())})" if got else ""
            lines.append(f"| {r['arm']} | {n} | did not run: {r['unavailable']}{far} | | | | | | | | | |")
            continue
        trl = "trl-vllm" if first("trl-vllm", n, "step_s") else "trl"
        base, ours = first(trl, n, "step_s"), first("qerl-nvfp4", n, "step_s")
        key = "device_peak_gib" if "device_peak_gib" in r and first(trl, n, "device_peak_gib") else "peak_gib"
        mem = first(trl, n, key)
        ratio = f"{r['step_s'] / base:.2f}x vs {trl}" if base else "-"
        mratio = f"{r[key] / mem:.2f}x" if mem else "-"
        faster = f"{r['step_s'] / ours:.2f}x" if ours else "-"
        one = " (1 step)" if r["steps"] == 1 else ""
        gen = f"{r['generate_s']:.1f}" if "generate_s" in r else "-"
        if "sync_s" in r:
            gen += f" ({r['sync_s']:.1f} sync)"
        upd = f"{r['update_s']:.1f}" if "update_s" in r else "-"
        dev = f"{r['device_peak_gib']:.1f}" if "device_peak_gib" in r else "-"
        lines.append(f"| {r['arm']} | {n} | {r['step_s']:.2f}{one} | {gen} | {upd} | {r['first_step_s']:.2f} | "
                     f"{r['cpu_s_per_step']:.2f} | {r['peak_gib']:.2f} | {dev} | {ratio} | {mratio} | {faster} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: str | Path) -> Path:
    """The table as a picture: per row count, one bar per arm that ran (generation, its weight sync apart where the
    arm has one, then the update; the step time and qerl NVFP4's speed-up at the end), fastest on top; a second
    panel gives each arm's peak (the device's where measured). Arms that did not run are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "step_s" in r]
    if not ran:
        raise ValueError("no arm in these rows ran: nothing to plot")
    counts = sorted({r.get("rows", 64) for r in ran})
    fig, axes = plt.subplots(len(counts), 2, figsize=(13, 0.55 * len(ran) + 1.6 * len(counts)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (speed, memory), n in zip(axes, counts):
        group = sorted((r for r in ran if r.get("rows", 64) == n), key=lambda r: r["step_s"], reverse=True)
        ours = next((r["step_s"] for r in group if r["arm"] == "qerl-nvfp4"), None)
        names = [r["arm"] for r in group]
        gen = [r.get("generate_s", 0.0) - r.get("sync_s", 0.0) for r in group]
        sync = [r.get("sync_s", 0.0) for r in group]
        upd = [r.get("update_s", r["step_s"] - r.get("generate_s", 0.0)) for r in group]
        speed.barh(names, gen, color="#4c72b0", label="generation")
        speed.barh(names, sync, left=gen, color="#8172b2", label="weight sync into vLLM")
        speed.barh(names, upd, left=[g + y for g, y in zip(gen, sync)], color="#dd8452", label="update")
        for i, r in enumerate(group):
            # qerl's other settings (memory first) are compared with its defaults, the peers with qerl NVFP4.
            who = "qerl's defaults" if r["arm"].startswith("qerl-") else "qerl NVFP4"
            note = f" {r['step_s']:.1f} s" + (f"  ({who} {r['step_s'] / ours:.2f}x faster)"
                                              if ours and r["arm"] != "qerl-nvfp4" else "")
            speed.text(r["step_s"], i, note, va="center", fontsize=8)
        speed.set_xlim(0, max(r["step_s"] for r in group) * 1.6)
        speed.set_xlabel("seconds per GRPO step (the arm's last step)")
        speed.set_title(f"{n} rows: step time, generation + update")
        speed.legend(loc="upper right", fontsize=8)  # fastest on top: its bar is the shortest
        peaks = [r.get("device_peak_gib", r.get("peak_gib", 0.0)) for r in group]
        memory.barh(names, peaks, color="#55a868")
        memory.set_yticks(range(len(names)), [""] * len(names))
        for i, v in enumerate(peaks):
            memory.text(v, i, f" {v:.0f}", va="center", fontsize=8)
        memory.set_xlim(0, max(peaks) * 1.3 if max(peaks) else 1)
        memory.set_xlabel("peak GiB (the device's where measured)")
        memory.set_title("memory")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default="", help="GPU work: a shape of bench_rollout.SHAPES (default 7b; tiny with "
                    "--tiny)")
    ap.add_argument("--tiny", action="store_true", help="the GPU arms' work at tiny size (a dry run on the CPU)")
    ap.add_argument("--arms", default="", help="comma-separated ARM or ARM@ROWS, or 'all'; default: every arm for "
                    "the device")
    ap.add_argument("--rows", type=int, default=PROMPTS_DEFAULT * GROUP, help="completions per step of an arm "
                    "without @ROWS (8 samples of rows / 8 prompts)")
    ap.add_argument("--vllm-memory", type=float, default=0.3, help="the vLLM arms' gpu_memory_utilization")
    ap.add_argument("--steps", type=int, default=4, help="steps per arm; the first pays one-offs")
    ap.add_argument("--arm-steps", default="", help="per-arm steps, e.g. trl=1,trl-qlora=1")
    ap.add_argument("--new", type=int, default=0, help="new tokens per completion (default 24 CPU, 1,024 GPU)")
    ap.add_argument("--repeat", type=int, default=1, help="run the arm list this many times, interleaved")
    ap.add_argument("--arm-timeout", type=float, default=0, help="seconds one arm may take (0: no limit)")
    ap.add_argument("--budget-s", type=float, default=0, help="seconds the whole run may take (0: no cap); each "
                    "arm's limit is the smaller of --arm-timeout and what is left")
    ap.add_argument("--unsloth-site", default=os.environ.get("PEERS_UNSLOTH_SITE", ""),
                    help="a folder put first on the unsloth arm's PYTHONPATH (its pinned TRL and datasets)")
    ap.add_argument("--out", default="outputs/peers")
    ap.add_argument("--table", nargs="+", metavar="JSONL", help="print the table of these runs' rows and exit")
    ap.add_argument("--plot", metavar="PNG", help="with --table: also draw it into this PNG")
    ap.add_argument("--save-model", action="store_true", help="write the vLLM and Unsloth arms' model folder into "
                    "PEERS_MODEL_DIR and exit (so a device call before theirs pays the 15 GB write)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or ("tiny" if args.tiny else "7b" if args.device == "cuda" else "embedded")
    if args.arm:
        sys.exit(one_arm(args))
    if args.save_model:
        if not os.environ.get("PEERS_MODEL_DIR"):
            print("bench_peers: --save-model writes into PEERS_MODEL_DIR, which is not set", file=sys.stderr)
            sys.exit(2)
        t0 = time.perf_counter()
        folder = peer_checkpoint(args, "", distinct_pad=True)
        print(f"bench_peers: {folder} ready ({time.perf_counter() - t0:.0f} s)")
        return
    if args.table:
        rows = [json.loads(line) for f in args.table for line in Path(f).read_text().splitlines() if line.strip()]
        print(table(rows, "cpu" if any(r.get("device") == "cpu" for r in rows) else "cuda"))
        if args.plot:
            try:
                print(f"bench_peers: {plot(rows, args.plot)}")
            except ValueError as e:
                print(f"bench_peers: --plot {args.plot}: {e}", file=sys.stderr)
                sys.exit(2)
        return
    start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    every = GPU_ARMS if args.device == "cuda" or args.tiny else CPU_ARMS
    try:
        if args.rows <= 0 or args.rows % GROUP:
            raise ValueError(f"--rows {args.rows} must be a positive multiple of the group size {GROUP}")
        arms = parse_arms(args.arms, every, args.rows)
    except ValueError as e:
        print(f"bench_peers: {e}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with open(Path(args.out) / "peers.jsonl", "a") as log:
        for _ in range(args.repeat):  # interleaved, so a change in the machine's load falls on every arm
            for arm, n in arms:
                limit = args.arm_timeout or float("inf")
                if args.budget_s:
                    limit = min(limit, args.budget_s - (time.perf_counter() - start) - 5)
                if limit < 30:
                    row = {"arm": arm, "rows": n,
                           "unavailable": f"no time left in the run's budget of {args.budget_s:.0f} s"}
                else:
                    row = run_arm(arm, n, args, limit)
                row.update(run_started=started, tiny=args.tiny, model=args.model)
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(json.dumps({k: v for k, v in row.items() if k != "times"}), flush=True)
    print("\n" + table(rows, args.device))


if __name__ == "__main__":
    main()
