"""Compile a run's GPU kernels in worker processes while its weights load, so that its first step does not.

On a machine whose Triton cache is empty, the first GRPO step of a 7B run took 2.1-2.4x a steady one (BENCHMARKS.md,
"The first step on a fresh machine"): about 22 kernels are compiled one after another as the step first launches
them, and Triton 3.6 also builds each one's launcher with the host's C compiler. Which variants a run needs depends
on its architecture and settings, not on its weights. So each worker builds a stand-in of the same shapes (two
layers and one of each attention kind, random weights, prepared by `prepare_base` as the real base is, with the
run's LoRA) and runs the kernel-launching path of a first step on it: the rollout at every batch bucket a step can
reach (prefill, decode, sampling) and one micro-batch of the update (forward, backward, the frozen forward). Each
worker compiles only its share of the kernels it meets (a hash of the kernel's specialization picks the worker); the
others it skips without launching them (Triton's `jit_cache_hook`), so N workers compile in parallel what one
process would compile in turn. What they compile lands in Triton's on-disk cache, where the trainer's own launches
find it. A stamp in that cache skips all of it when a run of the same code, shapes and settings already did it on
this machine.

Skipped kernels leave their outputs unwritten; nothing on this path branches on values, so every worker meets the
same kernels (a failed worker is a warning: the trainer compiles what is missing itself). Workers measure no GEMM
backend (timings taken while other workers share the GPU would be wrong) but run each candidate once
(their execution plan's gemm_tuning "compile"), so the trainer, which measures them once per machine in its first
step (qerl.kernels.dispatch), finds every candidate compiled. The stand-in has at least two layers: the kernels
between two layers (the residual add and the next layer's norm and LoRA input) exist only there.

Run as a worker: `python -m qerl.rl.precompile JOB.json`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl.config import ExecutionSettings, LoraSettings, ModelSettings, QuantSettings, Settings
from qerl.debug import variable
from qerl.execution import ExecutionPlan

log = logging.getLogger(__name__)

WAIT_S = 600  # a worker that takes longer is stopped: the trainer compiles what is left itself
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds qerl/ (and, in a source checkout, kernels/ beside it)


def jobs(settings: Settings, config, prompt_len: int, device: torch.device, workers: int) -> list[dict[str, Any]]:
    """One job per worker, alike but for its share. `config` is the base's `ModelConfig`, `prompt_len` the longest
    prompt in tokens. The buckets are the step's rows rounded up to a power of two, halved down to the smallest."""
    s = settings
    from qerl.rollout.kv_cache import CUDA_MIN_BUCKET, batch_buckets

    buckets = batch_buckets(s.rollout.prompts_per_step * s.rollout.group_size, CUDA_MIN_BUCKET)
    job = {
        "config": dataclasses.asdict(config), "model": dataclasses.asdict(s.model),
        "quant": dataclasses.asdict(s.quant), "lora": dataclasses.asdict(s.lora),
        "execution": dataclasses.asdict(s.execution),
        "temperature": s.rollout.temperature, "top_p": s.rollout.top_p, "top_k": s.rollout.top_k,
        "sigma": s.aqn.sigma_start if s.aqn.enabled else 0.0, "prompt_len": int(prompt_len),
        "prompts": s.rollout.prompts_per_step, "group_size": s.rollout.group_size, "buckets": buckets,
        "new_tokens": s.rollout.max_new_tokens, "micro_batch": s.grpo.micro_batch_size,
        "share_prompts": s.model.share_prompts and not s.lora.dropout,
        "device": str(device),
    }
    return [{**job, "share": i, "shares": workers} for i in range(workers)]


def _layer_weights(config) -> int:
    h = config.hidden_size
    attention = h * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return attention + 3 * h * config.intermediate_size


def weights_bytes(config, scheme: str) -> int:
    """An upper bound on the base's GPU bytes once loaded: 2 per weight in bf16, 1 in any quantized format (4-bit
    codes and their scales take ~0.56), the embedding and LM head in bf16."""
    heads = config.vocab_size * config.hidden_size * 2 * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * _layer_weights(config) * (2 if scheme == "bf16" else 1) + heads


def worker_count(config, tokens: int, reserved_bytes: int, device: torch.device) -> int:
    """How many workers to start: one per two CPU cores this process may use (compiling is CPU work), at most 8, and
    as many as the GPU's free memory holds beside `reserved_bytes` (what the trainer has yet to load) with 2 GiB to
    spare. A worker holds the tied embedding, its layers (counted as three bf16 ones: they are quantized one by
    one), its CUDA context, and one layer's activations for a micro-batch of `tokens`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    cpus = max(1, min(8, cores // 2))
    h, inter = config.hidden_size, config.intermediate_size
    per_worker = (2 * config.vocab_size * h + 6 * _layer_weights(config) + (600 << 20)
                  + tokens * (6 * inter + 20 * h) * 2)
    free = torch.cuda.mem_get_info(device)[0]
    return int(max(0, min(cpus, (free - reserved_bytes - (2 << 30)) // per_worker)))


def stamp_path(job: dict[str, Any]) -> Path:
    """Where the stamp of a job lives: in Triton's cache, keyed by the job (shapes and settings; not its share), the
    GPU, the library versions and the sources of qerl/ and kernels/ (a change to any kernel is a new stamp)."""
    import triton

    what = {k: v for k, v in job.items() if k not in ("share", "shares")}
    h = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    h.update(f"{gpu}|{torch.__version__}|{triton.__version__}".encode())
    for path in source_files():
        h.update(path.read_bytes())
    return _triton_cache_dir() / "qerl-precompiled" / h.hexdigest()[:32]


def source_files() -> list[Path]:
    """qerl's Python sources, the kernels' included: kernels/ lies inside qerl/ when installed, beside it in a
    checkout. qerl.kernels is a namespace package (no file of its own): its folder is its search path."""
    # qerl's folder by its file, not its search path: in a checkout that also holds the checkout's root
    folders = [Path(importlib.util.find_spec("qerl").origin).parent,
               *map(Path, importlib.util.find_spec("qerl.kernels").submodule_search_locations)]
    return sorted({path for folder in folders for path in folder.rglob("*.py")})


def _triton_cache_dir() -> Path:
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path(variable("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


class Precompile:
    """The worker processes of one `start`; `wait` joins them."""

    def __init__(self, job_list: list[dict[str, Any]], stamp: Path):
        self.stamp, self.started = stamp, time.perf_counter()
        self._dir = tempfile.TemporaryDirectory(prefix="qerl-precompile-")
        env = dict(os.environ, OMP_NUM_THREADS="1")  # the environment, passed on
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
        self.workers = []
        for i, job in enumerate(job_list):
            job_file = Path(self._dir.name) / f"job{i}.json"
            job_file.write_text(json.dumps({**job, "launched": time.time()}))
            out = open(Path(self._dir.name) / f"job{i}.log", "w")
            proc = subprocess.Popen([sys.executable, "-m", "qerl.rl.precompile", str(job_file)], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, cwd=_PACKAGE_ROOT)
            self.workers.append((proc, out))

    def wait(self, timeout_s: float = WAIT_S) -> bool:
        """Join the workers (stopping any still running after `timeout_s`); True if every one finished. A failed
        worker is a warning: the trainer compiles its share itself."""
        ok, summaries = True, []
        deadline = time.monotonic() + timeout_s
        for i, (proc, out) in enumerate(self.workers):
            try:
                rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            out.close()
            lines = Path(out.name).read_text(errors="replace").strip().splitlines()
            if rc != 0:
                ok = False
                log.warning("kernel precompile worker %d failed (exit %s): %s; the first step compiles its share",
                            i, rc, failure(lines))
            elif lines:
                summaries.append(lines[-1])
        if ok:
            self.stamp.parent.mkdir(parents=True, exist_ok=True)
            self.stamp.write_text(json.dumps({"workers": len(self.workers), "seconds": self.seconds()}))
        log.info("precompiled the run's GPU kernels in %d worker processes in %.1fs%s%s", len(self.workers),
                 self.seconds(), "" if ok else " (some failed)", f"; the last: {summaries[-1]}" if summaries else "")
        for line in summaries:
            log.debug("precompile worker: %s", line)
        self._dir.cleanup()
        return ok

    def stop(self) -> None:
        """Stop the workers without waiting for them (the trainer failed before its first step); no stamp."""
        for proc, out in self.workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            out.close()
        self._dir.cleanup()

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def failure(lines: list[str]) -> str:
    """A failed worker's output in one line: the last frame of ours in its traceback (a library's assert names
    neither the layer nor the call that reached it) and the traceback's last three lines."""
    ours = [line.strip() for line in lines if line.lstrip().startswith("File ") and "site-packages" not in line]
    return " | ".join(ours[-1:] + lines[-3:])


def start(settings: Settings, config, prompt_len: int, device: torch.device, loaded: bool) -> Precompile | None:
    """Start the workers for this run on `device` (a CUDA device with Triton); None when there is nothing to do:
    not CUDA, `model.precompile_kernels` off, this machine's Triton cache already has the stamp, or no GPU memory to
    spare for a worker beside the base (`loaded`: already on the GPU; otherwise its bytes are kept free)."""
    if device.type != "cuda" or not settings.model.precompile_kernels:
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    stamp = stamp_path(jobs(settings, config, prompt_len, device, 1)[0])
    if stamp.exists():
        log.info("GPU kernels of this run's shapes are in the Triton cache (%s)", stamp)
        return None
    tokens = settings.grpo.micro_batch_size * (prompt_len + settings.rollout.max_new_tokens)
    workers = worker_count(config, tokens, 0 if loaded else weights_bytes(config, settings.quant.scheme), device)
    if workers < 1:
        log.info("not precompiling GPU kernels: no GPU memory to spare for a worker process")
        return None
    log.info("precompiling the run's GPU kernels in %d worker processes (model.precompile_kernels)", workers)
    return Precompile(jobs(settings, config, prompt_len, device, workers), stamp)


# -- the worker ------------------------------------------------------------------------------------------------------


def compile_share(share: int, shares: int) -> dict[str, int]:
    """From now on this process compiles (and launches) only the Triton kernels whose specialization hashes to
    `share` of `shares`; it skips the rest without launching them. Returns the live counts of each."""
    from triton import knobs

    counts = {"compiled": 0, "skipped": 0}

    def hook(*, repr: str, compile: dict, **_) -> bool:
        what = str(compile.get("specialization_data") or repr)
        mine = int(hashlib.sha1(what.encode()).hexdigest(), 16) % shares == share
        counts["compiled" if mine else "skipped"] += 1
        return not mine  # True: Triton neither compiles nor launches it

    knobs.runtime.jit_cache_hook = hook
    return counts


def stand_in(job: dict[str, Any]):
    """The base's stand-in: its first two layers and the first of each attention kind, random weights, prepared as
    `load_base_model` prepares the real base, with the run's LoRA. The embedding is tied to the LM head (one
    vocabulary-sized matrix less in memory; the head's kernels do not see the difference)."""
    from qerl.model import lora
    from qerl.model.runtime import prepare_base
    from qerl.model.transformer import ModelConfig, Transformer

    cfg = dict(job["config"])
    types = cfg.get("layer_types")
    first_of_each = {t: i for i, t in reversed(list(enumerate(types)))}.values() if types else []
    layers = sorted({*range(min(2, cfg["num_hidden_layers"])), *first_of_each})
    cfg.update(num_hidden_layers=len(layers), tie_word_embeddings=True,
               layer_types=[types[i] for i in layers] if types else None)
    device = torch.device(job["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(**cfg), dtype=dtype, device=device)
    model.tie_weights()
    m = ModelSettings(**job["model"])
    # The GEMM dispatch runs every candidate once and measures nothing: each one's kernels get compiled for the
    # trainer, which measures them (kernels/dispatch.py)
    # Without the per-layer schemes (their globs may name layers the stand-in lacks) and the error correction (plain
    # torch matmuls, nothing to compile): the default scheme's kernels; an overridden layer's compile in step 1.
    quant = dataclasses.replace(QuantSettings(**job["quant"]), layer_schemes={}, error_correction_rank=0)
    plan = ExecutionPlan.from_settings(m, ExecutionSettings(**job["execution"]), device, quant, gemm_tuning="compile")
    prepare_base(model, m, quant, device, plan)
    lora.apply_lora(model, LoraSettings(**job["lora"]), dtype=dtype)
    return model


def run_rollout(model, job: dict[str, Any]) -> None:
    """Prefill the step's distinct prompts, one decode step at every bucket, sampling from each."""
    from qerl.rollout.factory import make_backend
    from qerl.rollout.sampling import sample_tokens, step_keys

    # No CUDA graphs: a capture launches the same kernels as the eager step it records.
    backend = make_backend(model, None, "engine", use_graphs=False)
    engine, P = backend.engine, job["prompt_len"]
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(0)
    rows, bucket = job["prompts"] * job["group_size"], job["buckets"][0]
    distinct = job["prompts"] + (rows < bucket)  # the rollout prefills each distinct prompt once (padding: one more)
    with backend.sync(job["sigma"], 0), torch.no_grad():
        engine.prepare(bucket, P, 1, all_buckets=True, prefill_rows=distinct)
        for rows in job["buckets"]:  # per-row keys, as the trainer's rollouts draw (row_seeds)
            sample_tokens(engine.logits_buf[:rows], job["temperature"], job["top_p"], job["top_k"], [generator] * rows,
                          step_keys(torch.zeros(rows, dtype=torch.long, device=engine.device), 0))
    backend.free()


def run_update(model, job: dict[str, Any]) -> None:
    """One micro-batch of the update per layout the trainer's can take: the forwards without a graph (frozen
    log-probs; idle rows' log-probs and entropies) and the forward and backward of the loss's log-probs, in the
    run's update precision. Its rows share prompts when they hold whole groups (the shared-prompt forward) and
    do not when every row's prompt differs (the plain forward: micro-batches of rows ordered by length mix groups),
    so both paths' kernels compile here and neither in the trainer's first step."""
    from qerl.execution import held_weights, update_precision
    from qerl.rl import grpo

    m = ModelSettings(**job["model"])
    device = model.lm_head.weight.device
    P, C, rows, group = job["prompt_len"], job["new_tokens"], job["micro_batch"], job["group_size"]
    g = torch.Generator().manual_seed(0)
    model.train()
    layouts = [-(-rows // group), rows] if job["share_prompts"] and group > 1 and rows > 1 else [rows]
    with update_precision(model, m.base_gemm), held_weights(model, 0 if m.keep_dequantized is False else 1 << 40):
        for distinct in layouts:
            prompts = torch.randint(model.config.vocab_size, (distinct, P), generator=g)
            prompt = prompts.repeat_interleave(-(-rows // distinct), 0)[:rows]
            ids = torch.cat([prompt, torch.randint(model.config.vocab_size, (rows, C), generator=g)], 1).to(device)
            attn = torch.ones_like(ids)
            with torch.no_grad():  # the frozen log-probs (μ > 1, β > 0), and the rows without a gradient (entropies)
                for want_entropy in (False, True):
                    grpo.completion_log_probs(model, ids, attn, P, job["temperature"], job["share_prompts"],
                                              want_entropy, m.pack_completions)
            logp, _ = grpo.completion_log_probs(model, ids, attn, P, job["temperature"], job["share_prompts"], True,
                                                m.pack_completions)
            logp.sum().backward()


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    times = [("start", time.time() - job.get("launched", time.time()))]  # the interpreter and its imports
    # Liger-kernel imports PEFT where it is installed only to report that it is, and PEFT imports transformers:
    # seconds of imports for two kernels that need neither (12 s on a machine without bytecode caches).
    sys.modules.setdefault("peft", None)
    counts = compile_share(job["share"], job["shares"]) if job["shares"] > 1 else {}
    begin = time.perf_counter()
    model = stand_in(job)
    times.append(("stand-in", time.perf_counter() - begin))
    for name, part in (("update", run_update), ("rollout", run_rollout)):
        begin = time.perf_counter()
        part(model, job)
        if model.lm_head.weight.is_cuda:
            torch.cuda.synchronize()
        times.append((name, time.perf_counter() - begin))
    print(f"share {job['share']}/{job['shares']}: " + ", ".join(f"{k} {v:.1f}s" for k, v in times)
          + "".join(f", {k} {v}" for k, v in counts.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
