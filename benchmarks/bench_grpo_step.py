"""The GRPO step a user runs, `qerl.rl.trainer.Trainer.train`, on random-weight Qwen2.5 shapes: seconds per phase and
peak GPU memory, per base format.

    PYTHONPATH=. python3 benchmarks/bench_grpo_step.py --models 7b,14b --schemes nvfp4,bf16,nf4-bnb --out DIR

Nothing here re-implements a phase: the model is built in the published shape with no adapters (q/k/v and gate/up
fused, as `load_base_model` leaves it on CUDA), and the trainer does the rest as in `qerl train`: it applies LoRA
(r=16 on all linears), samples 8 prompts x 8 completions through its rollout backend (the engine; AQN noise in the
norms, sigma 1e-2), scores them, and runs one DAPO update (micro-batches of 4, gradient checkpointing, AdamW).
What a real model needs and random weights lack is stood in for: a word-level tokenizer over the whole vocabulary
(every sampled id decodes; a word is a token), a system prompt of random words before the generated arithmetic
questions (prompts of about 256 tokens, no dataset to read), and a reward that hashes the completion's text (the
rewards vary, so the advantages are not all zero). A random policy almost never samples its end-of-sequence token,
so the completions run to `--new` tokens. Step 1 also pays the one-offs (graph capture, each training shape's GEMM
dispatch measurement, humming-kernels' JIT); the last step is reported, step 1 next to it. Results:
DIR/grpo_step.jsonl and a markdown table. The nf4-bnb arm is QLoRA as its users run it (bitsandbytes NF4 + LoRA;
needs `pip install -e ".[qlora]"`, else it is skipped).

The update with and without each group's prompt computed once (`model.share_prompts`, issue 48), at 64 rows of
256 + 1,024 and of 2,048 + 512 tokens (micro-batches of 8: one group's rows, so a micro-batch runs its prompt once):

    for shape in "--prompt 256 --new 1024" "--prompt 2048 --new 512"; do
      PYTHONPATH=. python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --micro 8 $shape --out DIR \
        --variants 'shared:model.share_prompts=true;plain:model.share_prompts=false;packed:model.pack_completions=true'
    done

(`packed`: `model.pack_completions` on top of shared prompts. A random policy's completions all run to `--new`, so
this arm measures what packing costs where there is no padding to skip, not what it saves on real completions.)

Ragged rollouts (`--lengths PRESET|FILE[,...]`, `benchmarks/lengths.py`): the trainer's completions end at a trace's
lengths, drawn per group (its 8 rows of one prompt): the rollout backend's `logits_processor` forces the numbered
tokenizer's EOS at each row's length (rows at the trace's cap run to it, truncated), so the engine's own EOS
bookkeeping ends them, and the update sees completions as ragged as RL's. Every step samples the same trace (step 1's
one-offs are then the shapes step 2 runs). max_new_tokens is the trace's cap (`--new N`: the trace scaled to cap N).
`--acceptance A` runs every arm's rollouts under `lengths.oracle_policy` (probability A on an oracle token per
position) and gives arms with `rollout.speculative=on` the oracle's drafts (`lengths.OracleDrafts`) instead of the
trainer's draft history, so a random-weight policy's speculation accepts each drafted token with probability A:

    PYTHONPATH=. python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --prompts 16 --lengths gsm8k \
        --acceptance 0.7 --variants 'plain:;packed:model.pack_completions=true;spec:rollout.speculative=on' --out DIR

Rows then also report the trace (median, truncated share), whether every completion ended exactly at its traced
length (`lengths_exact`), the update's completion tokens (the longest row x rows, or their sum when packed), and the
speculative metrics of the last step (`rollout.speculative=on` may be written bare: it is quoted for YAML). The logp
gap column means nothing on a trace: the rollouts' log-probs are those of the processed (forced-EOS) policy, not the
model's. `--device cpu` runs the arms on the CPU (dry runs at `--models tiny`);
`--budget S` skips the arms that the previous arm's time says would not fit.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_rollout import SCHEMES, bnb_version, build_model, free_cuda  # noqa: E402
from device_peak import DevicePeak  # noqa: E402
import lengths as traces  # noqa: E402
from qerl.config import load_settings, split_overrides  # noqa: E402
from qerl.rl.trainer import Trainer  # noqa: E402

GIB = 2**30
END = "<|end|>"
PAD = "<|pad|>"


def hash_reward(completion: str, gold: str) -> float:
    """A stand-in reward in [0, 1): a hash of the completion, so a random policy's rewards differ within a group."""
    return zlib.crc32(completion.encode()) % 1000 / 1000


def sparse_reward(completion: str, gold: str) -> float:
    """A stand-in for an early run's binary reward: 1 for about one completion in 8 (by hash), so about a third of
    the 8-sample groups score all zeros, whose rows have no gradient (advantage 0)."""
    return float(zlib.crc32(completion.encode()) % 8 == 0)


def numbered_tokenizer(vocab: int, distinct_pad: bool = False):
    """A word-level tokenizer over the model's whole vocabulary ("t0" ... , the last id the end token) whose chat
    template is the bare message contents: N words of a prompt are N tokens, and every id the policy samples decodes.
    Padding is the end token, or with `distinct_pad` a token of its own (PAD, the id before the end token) for tools
    that refuse a pad equal to EOS (Unsloth's fix_pad_token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    last_word = vocab - 2 if distinct_pad else vocab - 1
    words = {f"t{i}": i for i in range(last_word)} | {END: vocab - 1}
    if distinct_pad:
        words[PAD] = vocab - 2
    core = Tokenizer(models.WordLevel(words, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=END, pad_token=PAD if distinct_pad else END)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def ragged(backend, trace: "traces.Trace", eos: list[int], vocab: int, acceptance: float | None,
           speculative: bool, seen: list) -> None:
    """Make `backend`'s rollouts end at `trace`'s lengths (its logits processor: forced EOS, or the oracle policy at
    `acceptance`); with `speculative` and an acceptance, each call drafts from the oracle instead of the trainer's
    draft history. Each call's (completion lengths, stop reasons) go to `seen`."""
    if acceptance is None:
        backend.logits_processor = traces.forced_eos(trace.lengths, eos, vocab, cap=trace.cap)
    else:
        backend.logits_processor = traces.oracle_policy(trace.lengths, eos, vocab, acceptance, cap=trace.cap)
    generate = backend.generate

    def traced(prompts, sampling, progress=False, drafts=None):
        oracle = traces.OracleDrafts(vocab, eos) if speculative and acceptance is not None else None
        out = generate(prompts, sampling, progress=progress, drafts=oracle if oracle is not None else drafts)
        # what the oracle saw of this call: how many tokens it drafted, the per-token acceptance, and draws whose
        # logits were not finite (where the oracle's probability is not A)
        seen.append(([len(c) for c in out.completion_ids], list(out.stop_reasons),
                     {"oracle_drafted": oracle.proposed if oracle is not None else None,
                      "oracle_acceptance_observed": oracle.observed_acceptance() if oracle is not None else None,
                      "oracle_nonfinite_draws": getattr(backend.logits_processor, "nonfinite", lambda: None)()}))
        return out

    backend.generate = traced  # this backend object's own: the trainer calls it once a step


def grpo_step(name: str, scheme: str, prompts: int = 8, group: int = 8, prompt_len: int = 256, new: int | None = None,
              micro: int = 4, sigma: float = 1e-2, steps: int = 2, lora_rank: int = 16,
              overrides: tuple[str, ...] = (), variant: str = "default", reward: str = "hash",
              folder: str = "/tmp/qerl-vllm-bench", lengths: str = "", acceptance: float | None = None,
              trace_seed: int = 0, device: str = "cuda") -> dict:
    # YAML reads a bare on / off as a boolean: rollout.speculative=on as the string it means
    overrides = tuple(re.sub(r"^(rollout\.speculative)=(on|off|auto)$", r"\1='\2'", o) for o in overrides)
    trace = None
    # rollout.overprovision=x draws ceil(prompts * (1 + x)) prompts (RolloutSettings.prompts_drawn): the trace covers
    # every drawn row; its first prompts * group rows are the other arms' trace (lengths.draw is per group)
    extra = [o for o in overrides if o.startswith("rollout.overprovision=")]
    drawn = load_settings(overrides=[f"rollout.prompts_per_step={prompts}", *extra]).rollout.prompts_drawn
    if lengths:
        trace = traces.trace(lengths, drawn * group, group, trace_seed)
        trace = trace.scaled(new) if new else trace
        new = trace.cap
    new = new or 1024
    cuda = device == "cuda"
    r: dict = {"model": name, "scheme": scheme, "variant": variant, "settings": list(overrides),
               "rows": prompts * group, "rows_drawn": drawn * group, "prompt": prompt_len, "new": new,
               "micro_batch": micro}
    if trace is not None:
        stats = trace.stats()
        r.update(trace=trace.name, trace_seed=trace_seed, trace_median=stats["median"], trace_mean=stats["mean"],
                 trace_truncated_share=stats["truncated_share"], trace_tokens=stats["tokens"], acceptance=acceptance,
                 decode_step_share_below8=stats["decode_step_share_below8"])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base: list[str] = []
    if "rollout.backend=vllm" in overrides:
        # vLLM loads its base from a folder: the trainer's base is loaded from the same one (bench_vllm.py writes it)
        from bench_vllm import write_folder
        from qerl.model.runtime import load_base_model
        from qerl.model.served import own_model_settings

        write_folder(name, Path(folder))
        base = [f"model.path={folder}/bf16", "model.device=cuda"]
        if scheme.startswith("nvfp4"):
            base.append(f"quant.quantized_path={folder}/nvfp4")
        fp8 = ["quant.fp8_weights=false"] if scheme == "nvfp4-4bit" else []
        # as `qerl train` loads it beside vLLM (own_model_settings: no FP8 copies unless the update reads them)
        loaded = own_model_settings(load_settings(overrides=[*base, f"quant.scheme={scheme.replace('-4bit', '')}",
                                                             *fp8, *overrides]))
        model, _ = load_base_model(loaded.model, loaded.quant)
    else:
        # the trainer applies LoRA after the fusion, as `qerl train` (fused on CUDA, as load_base_model leaves it)
        # built with the arm's quant settings that act when the base is made (FP8 copies, the remedies)
        q = load_settings(overrides=list(overrides)).quant
        model = build_model(name, scheme, lora_rank=0, device=device, fuse=cuda, fp8_activations=q.fp8_activations,
                            layer_schemes=q.layer_schemes, correction_rank=q.error_correction_rank)
    r["weights_gib"] = torch.cuda.memory_allocated() / GIB if cuda else 0.0
    vocab = model.config.vocab_size
    tokenizer = numbered_tokenizer(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        rng = random.Random(0)
        # The generated arithmetic questions (a few words each) after a system prompt of random words: prompts of
        # about `prompt_len` tokens, each distinct (the engine prefills each distinct prompt once).
        system = " ".join(f"t{rng.randrange(vocab - 1)}" for _ in range(prompt_len - 8))
        quant = ["quant.scheme=nvfp4", "quant.fp8_weights=false"] if scheme == "nvfp4-4bit" \
            else [f"quant.scheme={scheme}"]  # the model is built so (bench_rollout.build_model); recorded as such
        s = load_settings(overrides=[
            f"model.path=random-{name}", *quant, *base, f"lora.rank={lora_rank}",
            f"lora.alpha={2 * lora_rank}", f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}",
            f"rollout.max_new_tokens={new}", "rollout.temperature=1.0", "grpo.loss_type=dapo",
            f"grpo.micro_batch_size={micro}", "grpo.dynamic_sampling=false", "grpo.mask_truncated=false",
            "aqn.enabled=true", f"aqn.sigma_start={sigma}", f"aqn.sigma_end={sigma / 2}", "aqn.num_stages=2",
            f"train.steps={steps}", "train.eval_every=0", f"train.save_every={steps}", "data.name=arithmetic",
            "tracking.backend=none", *overrides])
        s.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        # Tokens through the blocks per forward of the update: every row's prompt and completion, or with
        # model.share_prompts each micro-batch's distinct prompts once (rows are group-major; a random policy's
        # completions run to `new` tokens)
        rows = prompts * group
        shared = sum(len({row // group for row in range(first, min(first + micro, rows))})
                     for first in range(0, rows, micro)) if s.model.share_prompts else rows
        completions = rows * new
        packed = s.model.pack_completions
        if trace is not None:  # the batch is padded to its longest completion, unless packed
            first_rows = trace.lengths[:rows]  # the trained rows (with rollout.overprovision: corrected after the run)
            completions = sum(first_rows) if packed else rows * max(first_rows)
        r["update_tokens"] = shared * prompt_len + completions
        s.data.system_prompt = system
        # "hash" / "sparse": stand-ins that cost nothing; "accuracy": the product's default reward, the math grader
        # (math-verify in a worker process where installed) on these completions: what grading costs in a step
        stand_in = reward in ("hash", "sparse")  # this folder is on sys.path
        s.train.rewards = {f"bench_grpo_step:{reward}_reward" if stand_in else reward: 1.0}
        r["reward"] = reward
        start = time.perf_counter()
        with Trainer(s, Path(tmp) / "run", model=model, tokenizer=tokenizer) as trainer:
            r["setup_s"] = time.perf_counter() - start  # the trainer's own setup (the model is built before it)
            seen: list = []
            if trace is not None:
                from qerl.rollout.sampling import default_eos_ids

                ragged(trainer.rollout_backend, trace, default_eos_ids(model, tokenizer), vocab, acceptance,
                       s.rollout.speculative != "off", seen)
            trainer.train()
            # a run whose LoRA went non-finite samples garbage from then on (and accepts no draft): say so
            r["trainable_finite"] = bool(all(bool(torch.isfinite(q).all()) for q in model.parameters()
                                             if q.requires_grad))
            engine = getattr(trainer.rollout_backend, "engine", None)  # the vLLM backend holds its own
            r["kv_gib"] = engine.memory_bytes() / GIB if engine is not None else float("nan")
            rows = trainer.run.metrics.read()
            trainer.rollout_backend.free()
    first, last = rows[0], rows[-1]
    r.update(steps=steps, rollout_s=last["seconds_rollout"], update_s=last["seconds_update"],
             scoring_s=last["seconds_scoring"], response_length=last["response_length"],
             rollout_tok_s=last["rollout_tokens_per_s"], peak_gib=last["peak_memory_gb"],
             reserved_gib=torch.cuda.max_memory_reserved() / GIB if cuda else 0.0,
             rollout_logp_gap=last["rollout_logp_gap/mean"],
             first_rollout_s=first["seconds_rollout"], first_update_s=first["seconds_update"],
             recomputed_blocks=last["recomputed_blocks"], held_weights_gib=last["held_weights_gib"],
             rollout_s_by_step=[m["seconds_rollout"] for m in rows],  # step-to-step spread: ~±0.3 s of update
             update_s_by_step=[m["seconds_update"] for m in rows],
             loss_by_step=[m.get("loss") for m in rows], grad_norm_by_step=[m.get("grad_norm") for m in rows],
             entropy_by_step=[m.get("entropy") for m in rows])
    r["step_s"], r["first_step_s"] = (m["seconds_rollout"] + m["seconds_scoring"] + m["seconds_update"]
                                      for m in (last, first))
    r["sigma"] = sigma
    if trace is not None:  # every step's completions ended where the trace says (EOS, or the cap: truncated)
        want = ["length" if n >= trace.cap else "eos" for n in trace.lengths]
        # rows of groups cut by rollout.overprovision stop wherever they were: only the kept rows are checked
        r["lengths_exact"] = bool(seen) and all(
            all(why == "cut" or (n, why) == (trace.lengths[i], want[i]) for i, (n, why) in enumerate(zip(made, reasons)))
            for made, reasons, _ in seen)
        made, reasons, _ = seen[-1] if seen else ([], [], None)
        kept = [n for n, why in zip(made, reasons) if why != "cut"]
        if extra and kept:  # the update trains the kept groups: padded to their longest, or packed
            r["update_tokens"] = (r["update_tokens"] - completions
                                  + (sum(kept) if packed else len(kept) * max(kept)))
        r["groups_dropped"] = last.get("rollout/groups_dropped")
        r.update(seen[-1][2] if seen else {})  # the last step's (the nonfinite count: the run's so far)
        r["nonfinite_by_call"] = [extra_seen["oracle_nonfinite_draws"] for _, _, extra_seen in seen]  # cumulative
        r.update({k: last[k] for k in last if k.startswith("speculative/")})
        r["speculative"] = any(k.startswith("speculative/") for k in last)
    del model
    free_cuda()
    return r


def table(rows: list[dict]) -> str:
    lines = ["| model | base | variant | lengths | recomputed blocks | weights GiB | KV GiB | rollout s (tok/s) | "
             "scoring s | update s (tokens) | step s (step 1) | peak GiB | reserved GiB | device peak GiB | logp gap | "
             "step speed vs bf16 / vs QLoRA |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    step = {(r["model"], r["scheme"], r["variant"], r.get("trace")): r["step_s"] for r in rows}

    def speedup(r: dict, scheme: str) -> str:
        other = step.get((r["model"], scheme, r["variant"], r.get("trace")))
        return f"{other / r['step_s']:.2f}x" if other else "-"

    for r in rows:
        shape = "fixed" if r.get("trace") is None else (
            f"{r['trace']} (exact {r.get('lengths_exact')}" + (
                f", accepted {r['speculative/acceptance']:.2f})" if "speculative/acceptance" in r else ")"))
        lines.append(f"| {r['model']} | {r['scheme']} | {r['variant']} | {shape} | {r['recomputed_blocks']} | "
                     f"{r['weights_gib']:.1f} | {r['kv_gib']:.1f} | "
                     f"{r['rollout_s']:.1f} ({r['rollout_tok_s']:,.0f}) | {r['scoring_s']:.2f} | "
                     f"{r['update_s']:.1f} ({r.get('update_tokens', 0):,}) | "
                     f"{r['step_s']:.1f} ({r['first_step_s']:.1f}) | {r['peak_gib']:.1f} | {r['reserved_gib']:.1f} | "
                     f"{r.get('device_peak_gib', float('nan')):.1f} | "
                     f"{r['rollout_logp_gap']:.3f} | {speedup(r, 'bf16')} / {speedup(r, 'nf4-bnb')} |")
    return "\n".join(lines)


def parse_variants(spec: str) -> list[tuple[str, tuple[str, ...]]]:
    """'label:key=value,key=value;label2:...' -> [(label, overrides)] (a value's commas inside its brackets stay
    its own: qerl.config.split_overrides); '' -> the product defaults."""
    if not spec:
        return [("default", ())]
    out = []
    for part in filter(None, spec.split(";")):
        label, _, sets = part.partition(":")
        out.append((label, tuple(split_overrides(sets))))
    return out


def run_arm(name: str, scheme: str, variant: str, overrides: tuple[str, ...], args, lengths: str = "",
            timeout: float | None = None) -> dict | None:
    """One arm in its own process: its peak memory and its one-offs are its own, not the earlier arms' leftovers.
    `lengths`: its trace ("": fixed lengths); `timeout`: seconds before the arm is stopped (the budget)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--arm", name, scheme, variant, "--row", str(result),
               "--prompts", str(args.prompts), "--prompt", str(args.prompt), *(["--new", str(args.new)] if args.new
                                                                               else []),
               "--micro", str(args.micro), "--sigma", str(args.sigma), "--device", args.device,
               "--steps", str(args.steps), "--reward", args.reward, "--folder", args.folder,
               "--trace-seed", str(args.trace_seed), *(["--lengths", lengths] if lengths else []),
               *(["--acceptance", str(args.acceptance)] if args.acceptance is not None else []),
               *(x for o in overrides for x in ("--set", o))]
        try:
            rc = subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"[{name} {scheme} {variant}] stopped at the budget ({timeout:.0f} s)", flush=True)
            return None
        if rc != 0 or not result.exists():
            print(f"[{name} {scheme} {variant}] arm process failed (exit {rc})", flush=True)
            return None
        return json.loads(result.read_text())


def one_arm(args) -> int:
    name, scheme, variant = args.arm
    # The device's own figure beside the trainer's peak_memory_gb: what a colocated vLLM holds in its own pool
    # (and gives back asleep) is where the two could part
    device_peak = DevicePeak.begin("bench_grpo_step") if args.device == "cuda" else None
    try:
        r = grpo_step(name, scheme, prompts=args.prompts, prompt_len=args.prompt, new=args.new, micro=args.micro,
                      sigma=args.sigma, steps=args.steps,
                      overrides=tuple(args.set), variant=variant, reward=args.reward, folder=args.folder,
                      lengths=args.lengths, acceptance=args.acceptance, trace_seed=args.trace_seed,
                      device=args.device)
    except ImportError as e:  # the QLoRA arm without bitsandbytes
        print(f"[{name} {scheme}] skipped: {e}", flush=True)
        return 3
    except torch.OutOfMemoryError as e:
        print(f"[{name} {scheme}] out of memory: {str(e).splitlines()[0]}", flush=True)
        return 4
    r["device_peak_gib"] = device_peak.stop() if device_peak is not None else float("nan")
    Path(args.row).write_text(json.dumps(r))
    print(f"[{name} {scheme} {variant}] " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in r.items()), flush=True)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b,14b")
    ap.add_argument("--schemes", default="nvfp4,bf16,nf4-bnb", help=f"any of {', '.join(SCHEMES)}")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (8 samples each): 8 = 64 rows")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (about: a system prompt of random words "
                    "before a short question)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per completion (default 1024); with --lengths: "
                    "the trace scaled to this cap (default: the trace's own)")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--sigma", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=2, help="steps per arm; the last is reported (step 1 pays one-offs)")
    ap.add_argument("--reward", default="hash", choices=["hash", "sparse", "accuracy"],
                    help="hash: a free stand-in; sparse: 1 for ~1 completion in 8 (groups of all zeros); "
                    "accuracy: the default math grader (its cost is the scoring column)")
    ap.add_argument("--out", default="outputs/bench")
    ap.add_argument("--folder", default="/tmp/qerl-vllm-bench", help="where arms with rollout.backend=vllm find (or "
                    "write) the base folder vLLM loads (benchmarks/bench_vllm.py)")
    ap.add_argument("--variants", default="", help="arms of settings, e.g. 'ckpt:model.gradient_checkpointing=true;"
                    "auto:' (label:key=value,...; each arm runs every scheme); default: the product's defaults")
    ap.add_argument("--lengths", default="", help="ragged rollouts: completion-length traces, comma-separated (each "
                    f"a preset of benchmarks/lengths.py: {', '.join(traces.PRESETS)}, or a FILE); every arm runs each")
    ap.add_argument("--trace-seed", type=int, default=0)
    ap.add_argument("--acceptance", type=float, default=None, help="with --lengths: the oracle policy's acceptance "
                    "(every arm samples it; arms with rollout.speculative=on draft from the oracle)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for dry runs (--models tiny)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds for all arms: an arm is skipped when the "
                    "slowest arm so far would not fit in what is left, and stopped at the budget")
    ap.add_argument("--arm", nargs=3, help=argparse.SUPPRESS)  # internal: run one arm in this process
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.arm:
        sys.exit(one_arm(args))
    os.makedirs(args.out, exist_ok=True)
    from qerl.kernels import nvfp4_ops

    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        where = f"{torch.cuda.get_device_name()} ({total:.0f} GiB)"
    else:
        where = args.device
    print(f"device {where} | NVFP4 Triton kernels "
          f"{'available' if nvfp4_ops.available() else 'NOT available (PyTorch dequantize path)'} | "
          f"bitsandbytes {bnb_version()}", flush=True)
    rows, skipped, slowest = [], [], 0.0
    start = time.perf_counter()
    with open(os.path.join(args.out, "grpo_step.jsonl"), "a") as log:
        for name in args.models.split(","):
            for lengths in args.lengths.split(",") if args.lengths else [""]:
                for variant, overrides in parse_variants(args.variants):
                    for scheme in args.schemes.split(","):
                        arm = f"{name} {scheme} {variant}" + (f" {lengths}" if lengths else "")
                        left = args.budget - (time.perf_counter() - start)
                        if slowest * 1.1 > left:
                            skipped.append(f"{arm} (budget: {left:.0f} s left, the slowest arm took {slowest:.0f})")
                            continue
                        t0 = time.perf_counter()
                        r = run_arm(name, scheme, variant, overrides, args, lengths, timeout=max(1.0, left))
                        slowest = max(slowest, time.perf_counter() - t0)
                        if r is None:
                            continue
                        r["arm_s"] = time.perf_counter() - t0
                        rows.append(r)
                        log.write(json.dumps(r) + "\n")
                        log.flush()
    print("\n" + table(rows))
    if skipped:
        print("\nnot run: " + "; ".join(skipped))


if __name__ == "__main__":
    main()
