"""Rollout throughput of qerl's engine (bf16+LoRA, NVFP4+LoRA, and QLoRA: bitsandbytes NF4+LoRA) on random-weight
Qwen2.5 shapes (and one row per other family: mistral-7b, phi4-14b, gemma3-4b, gemma3-12b), with Hugging Face
`generate` (bf16, eager) as the outside anchor.

    PYTHONPATH=. python3 benchmarks/bench_rollout.py --models 7b,32b --batches 8,32,64,128 --new 256,1024 \
        [--schemes bf16,nvfp4,nf4-bnb,fp8] [--long-batches 64] [--hf] [--plain] --out DIR [--budget SECONDS]

The nf4-bnb arm (quant.scheme nf4-bnb: bitsandbytes' Linear4bit storage and `matmul_4bit`, as TRL and Unsloth run
QLoRA) needs bitsandbytes (`pip install -e ".[qlora]"`); without it that arm is skipped and named at the end.

Every row generates exactly `new` tokens (EOS ignored), from 256-token random prompts, temperature 1. Tokens/s =
batch * new / wall time of one `RolloutEngine.generate` call, prefill included, after `engine.prepare` (graph
capture is a one-off per engine, reported separately). Results: DIR/rollout.jsonl and a markdown table on stdout.

Ragged rollouts, the lengths RL produces (`benchmarks/lengths.py`: presets gsm8k, long-cot, or a FILE of lengths):

    PYTHONPATH=. python3 benchmarks/bench_rollout.py --models 7b --schemes bf16,nvfp4 --batches 128 \
        --lengths gsm8k,long-cot [--speculative off,on --acceptance 0.5,0.7,0.9 --speculative-rows 8,16] --out DIR

Each row ends at its traced length: the trace is drawn per GRPO group (`--group` rows of one prompt; the prompts are
`--prompt`-token random ones, one per group, as the trainer lays a step out) and `lengths.forced_eos` makes the policy
sample EOS there (rows at the trace's cap run to it, truncated), so the engine's own EOS bookkeeping, compaction and
buckets end the rows. max_new_tokens is the trace's cap (`--new N`: the trace scaled to cap N, its shape kept: CPU dry
runs). Reported per arm: useful tokens/s (the completions' tokens / wall time of the call, prefill included), the
share of decode steps below 8 live rows (exact, from the lengths) and of decode wall time (the engine's timeline),
and NVFP4 over bf16. Each engine's first call of a trace is preceded by the same call untimed (graph capture of the
buckets and windows the trace reaches, as a warm trainer has them); so is its first speculative call at each
`--speculative-rows` (the verify graphs); `captures_timed` says whether a timed call still captured one.

`--speculative on` adds arms whose engine decodes speculatively once <= `--speculative-rows` rows are live. Random
weights have nothing a real draft source could predict, so with `--acceptance A` a synthetic policy and draft source
stand in (`lengths.oracle_policy`, `lengths.OracleDrafts`): the logits processor also puts probability A on an
oracle token o(row, position) (a fixed hash) and the drafts propose the oracle tokens ahead, so each draft token is
accepted with probability A. The plain arm runs the same processor (at the first A: its cost does not depend on A),
so both sample the same distribution and lengths; spec/plain is reported at each A with the engine's
accepted/drafted. Without `--acceptance` speculative arms draft from the call's own prompts and rows (random
weights: almost nothing to accept). `--device cpu` runs it all on the CPU (dry runs at `--models tiny`).
"""
from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qerl.config import QuantSettings  # noqa: E402
from qerl.execution import ExecutionPlan, attach  # noqa: E402
from qerl.model.lora import LoraSettings, apply_lora  # noqa: E402
from qerl.model.transformer import DecoderLayer, ModelConfig, RMSNorm, Transformer  # noqa: E402
from qerl.quant.bnb import quantize_model_bnb, require_bitsandbytes  # noqa: E402
from qerl.quant.linear import plan_fp8_weights, quantize_model  # noqa: E402
from qerl.rollout.engine import RolloutEngine  # noqa: E402
from qerl.rollout.speculation import MAX_QUERIES  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lengths as traces  # noqa: E402

# Published shapes (the config.json of Qwen/Qwen2.5-{7B,14B,32B}-Instruct on the Hugging Face hub);
# Qwen2 = bias on q/k/v, GQA, SwiGLU, rope theta 1e6.
SHAPES = {
    # A CPU dry run of the GPU benchmarks' code paths (bench_peers.py --tiny): the 7B's architecture, tiny sizes.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
    # The other families (qerl.model.families), published config.json values written down from the model cards (no hub
    # here to check them against); each key overrides hf_config's Qwen2 defaults.
    # Mistral-7B-Instruct-v0.3: no sliding window (v0.2+), rope theta 1e6.
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, rms_norm_eps=1e-5,
                       sliding_window=None),
    # Phi-4 (14B; Phi-3's architecture): stacked qkv_proj / gate_up_proj, head_dim 128. Phi-3-mini's head_dim 96
    # would take the plain decode path (the RoPE kernel needs a power-of-two half), Phi-4-mini's partial RoPE
    # and LongRoPE are not supported.
    "phi4-14b": dict(model_type="phi3", hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                     num_attention_heads=40, num_key_value_heads=10, vocab_size=100352, rope_theta=2.5e5,
                     rms_norm_eps=1e-5, max_position_embeddings=16384, sliding_window=None),
    # Gemma 3 4B / 12B text decoders: 5 local layers (window 1024, RoPE base 1e4) per global one (base 1e6,
    # linear scaling 8), head_dim 256, query_pre_attn_scalar 256, tied 262k embeddings.
    "gemma3-4b": dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                      query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                      rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                      tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072),
    "gemma3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                       query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                       rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                       tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                       max_position_embeddings=131072),
}


DEVICE = "cuda"
# nvfp4 is the product's default (quant.fp8_weights: auto, quant.fp8_activations: false: bf16 activations, no FP8
# copies); nvfp4-4bit the same base with quant.fp8_weights: false; fp8 the FP8 base (quant.scheme: fp8, E4M3 with
# per-channel scales: kernels/fp8_gemm.py). A `-w8a8` suffix runs the base with quant.fp8_activations: true (W8A8
# forwards outside the update where faster: `_scaled_mm`, NVFP4's resident FP8 copies; the default until
# 2026-12-04, so the plain names of earlier BENCHMARKS.md sections are these), `-bf16-act` with it false (pinned).
SCHEMES = ("bf16", "nvfp4", "nvfp4-4bit", "nf4-bnb", "fp8", "nvfp4-bf16-act", "fp8-bf16-act", "nvfp4-w8a8",
           "fp8-w8a8")
DEFAULT_SCHEMES = SCHEMES[:4]  # --schemes' default: the arms the chains of earlier sessions ran (fp8 on request)
LABELS = {"bf16": "qerl bf16+LoRA", "nvfp4": "qerl NVFP4+LoRA", "nvfp4-4bit": "qerl NVFP4+LoRA, 4-bit only",
          "nf4-bnb": "qerl bnb-NF4+LoRA (QLoRA)", "fp8": "qerl FP8+LoRA",
          "nvfp4-bf16-act": "qerl NVFP4+LoRA, bf16 activations", "fp8-bf16-act": "qerl FP8+LoRA, bf16 activations",
          "nvfp4-w8a8": "qerl NVFP4+LoRA, W8A8", "fp8-w8a8": "qerl FP8+LoRA, W8A8"}


KV_LABELS = {"model": "", "fp8": ", FP8 KV"}


def hf_config(name: str) -> dict:
    return {"model_type": "qwen2", "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "tie_word_embeddings": False, **SHAPES[name]}


@torch.no_grad()
def build_model(name: str, scheme: str, lora_rank: int = 16, device: str = "cuda", seed: int = 0,
                fuse: bool = True, lora_epilogue: bool = False, fp8_activations: bool | None = None,
                layer_schemes: dict[str, str] | None = None, correction_rank: int = 0) -> Transformer:
    """Random-weight model of a published shape, bf16, decoder linears in `scheme` (one of SCHEMES), LoRA on
    all of them, q/k/v and gate/up fused as `load_base_model` does on CUDA (`fuse`). Built layer by layer (each
    quantized as soon as it exists), so a 32B model never sits in bf16 on the GPU: peak = the quantized model + one
    bf16 layer. Its execution plan: the defaults (eager training ops), with `lora_epilogue`
    (execution.lora_epilogue) and `fp8_activations` (quant.fp8_activations; None: the scheme's suffix, else the
    default), which also decides whether NVFP4 keeps FP8 copies. `layer_schemes` and `correction_rank`: the
    remedies quant.layer_schemes (globs on the qualified names, `model.layers.3.mlp.down_proj`) and
    quant.error_correction_rank, applied as `qerl train` applies them."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if fp8_activations is None:
        fp8_activations = scheme.endswith("-w8a8") or (QuantSettings.fp8_activations
                                                       and not scheme.endswith("-bf16-act"))
    scheme = scheme.removesuffix("-bf16-act").removesuffix("-w8a8")
    plan = ExecutionPlan(lora_epilogue=lora_epilogue, fp8_activations=fp8_activations,
                         fp8_weights="auto" if scheme == "nvfp4" else False)  # quant.fp8_weights, as prepare_base
    scheme = "nvfp4" if scheme == "nvfp4-4bit" else scheme
    if scheme == "nf4-bnb":
        require_bitsandbytes()  # one line saying how to install it, before any GPU memory is touched
    used: set[str] = set()

    def own_schemes(layer: nn.Module, i: int) -> dict[str, str]:
        """layer_schemes as exact layer-local names (quantize_model sees one layer at a time)."""
        out = {}
        for local, m in layer.named_modules():
            glob = next((g for g in layer_schemes or {} if fnmatch.fnmatchcase(f"model.layers.{i}.{local}", g)), None)
            if isinstance(m, nn.Linear) and glob is not None:
                out[local] = layer_schemes[glob]
                used.add(glob)
        return out

    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf(hf_config(name))
    model = Transformer.from_config(cfg, dtype=torch.bfloat16, device="meta")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            model.lm_head.weight.normal_(0, cfg.hidden_size ** -0.5)
            model.tie_weights()  # Gemma: one embedding matrix
            model.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family.unit_offset_norms)
            for i in range(cfg.num_hidden_layers):
                layer = DecoderLayer(cfg, i)  # nn.Linear's default (kaiming-uniform) init; i: local or global
                if scheme in ("nvfp4", "fp8"):  # NVFP4: q/k/v and gate/up share global scales
                    quantize_model(layer, scheme, pattern=r".", layer_schemes=own_schemes(layer, i),
                                   correction_rank=correction_rank)
                elif scheme == "nf4-bnb":
                    quantize_model_bnb(layer, pattern=r".")  # bitsandbytes' quantize_4bit, on the GPU
                model.model.layers[i] = layer
    finally:
        torch.set_default_dtype(previous)
    if unused := sorted(set(layer_schemes or {}) - used):
        raise ValueError(f"layer_schemes: {unused} match no decoder linear (named like model.layers.0.mlp.down_proj)")
    model.model.rotary_emb.to_empty(device=device)  # recomputes inv_freq on the device
    model.requires_grad_(False)  # a frozen base, as load_base_model leaves it (bf16 weights fuse only when frozen)
    if lora_rank:
        params = apply_lora(model, LoraSettings(rank=lora_rank, alpha=2 * lora_rank), dtype=torch.bfloat16)
        for p in params:
            if p.dim() == 2 and p.shape[1] == lora_rank:  # lora_B: non-zero so the update path does real work
                p.normal_(0, 1e-3)
    plan_fp8_weights(model, plan.fp8_copies, torch.device(device))  # before fusing, as prepare_base
    if fuse:
        model.fuse_projections()
    attach(model, plan)  # one GEMM context for the layers built one by one
    return model.eval()


def bnb_version() -> str:
    try:
        return require_bitsandbytes().__version__
    except ImportError:
        return "not installed (the nf4-bnb arm is skipped)"


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def allocated_gib(peak: bool = False) -> float:
    if DEVICE != "cuda":
        return 0.0
    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**30


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def time_engine(engine: RolloutEngine, batch: int, prompt_len: int, new: int, vocab: int) -> dict:
    t0 = time.perf_counter()
    engine.prepare(batch, prompt_len, new)
    capture_s = time.perf_counter() - t0
    prompts = random_prompts(batch, prompt_len, vocab)
    # Untimed warm-up, as bench_vllm's vLLM arm has one: the first rollout of a process also pays for one-time work
    # prepare() does not do (the sampler's compile, the GEMM dispatch timing this prefill's shape, which a rollout
    # prefills once per distinct prompt). Timed with it, a 7B NVFP4 one-row rollout read 183 tok/s against ~280 warm.
    engine.generate(None, prompts, 8, temperature=1.0, eos_token_ids=[], seed=1)
    sync()
    t0 = time.perf_counter()
    out = engine.generate(None, prompts, new, temperature=1.0, eos_token_ids=[], seed=0)
    sync()
    seconds = time.perf_counter() - t0
    assert all(len(c) == new for c in out.completion_ids)
    return {"seconds": seconds, "tokens_per_s": batch * new / seconds, "capture_s": capture_s,
            "graphs": len(engine.graphs), "use_graphs": engine.use_graphs, "kernels": engine.kernels}


def hf_anchor(name: str, batch: int, prompt_len: int, new: int) -> dict:
    """transformers' own model of the shape's family in bf16, eager `generate` (dynamic cache), greedy, fixed
    length."""
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SHAPES[name]
    # The config qerl reads, as transformers writes it (to_hf): the same architecture on both sides.
    config = AutoConfig.for_model(**{**ModelConfig.from_hf(hf_config(name)).to_hf(), "eos_token_id": None,
                                     "pad_token_id": 0, "bos_token_id": None})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor(random_prompts(batch, prompt_len, s["vocab_size"]), device=DEVICE)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, min_new_tokens=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kw)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, **kw)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    made = out.shape[1] - prompt_len
    del model
    free_cuda()
    return {"seconds": seconds, "tokens_per_s": batch * made / seconds, "new": made}


# ------------------------------------------------------------------------------------------------ ragged rollouts


def group_prompts(batch: int, group: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` rows of random prompts, `group` consecutive rows per prompt (a GRPO step's layout; a last partial group
    is cut)."""
    distinct = random_prompts(-(-batch // group), length, vocab, seed)
    return [p for p in distinct for _ in range(group)][:batch]


def time_ragged(engine: RolloutEngine, prompts: list[list[int]], trace: "traces.Trace", processor, drafts_factory,
                eos: int, warm_up: bool) -> dict:
    """One timed `generate` of `prompts` whose rows end at `trace`'s lengths (`processor`: the trace's forced EOS, or
    the oracle policy), after the same call untimed when `warm_up`; `drafts_factory()`: each call's draft source (or
    None). Returns the timing, the live-row profile and the engine's counts of the timed call."""
    sources: list = []

    def call():
        sources.append(drafts_factory())
        return engine.generate(None, prompts, trace.cap, temperature=1.0, eos_token_ids=[eos], seed=0,
                               drafts=sources[-1], logits_processor=processor)

    warmup_s = 0.0
    if warm_up:
        t0 = time.perf_counter()
        call()
        sync()
        warmup_s = time.perf_counter() - t0
    before = dict(engine.stats)
    engine.timeline = []
    sync()
    t0 = time.perf_counter()
    out = call()
    sync()
    seconds = time.perf_counter() - t0
    timeline, engine.timeline = engine.timeline, None
    made = [len(c) for c in out.completion_ids]
    tokens = sum(made)
    # every row ended where its trace says, by EOS, or truncated at the cap by the length limit
    exact = made == list(trace.lengths) and all(
        reason == ("length" if n >= trace.cap else "eos") for n, reason in zip(trace.lengths, out.stop_reasons))
    counts = {k: engine.stats.get(k, 0) - before.get(k, 0) for k in engine.stats}
    r = {"seconds": seconds, "tokens": tokens, "useful_tokens_per_s": tokens / seconds,
         "tokens_per_s": tokens / seconds,  # the fixed rows' key: every token is useful there
         "warmup_s": warmup_s, "lengths_exact": exact, "decode_steps": counts.get("steps", 0),
         "verify_steps": counts.get("verify_steps", 0), "drafted": counts.get("drafted", 0),
         "accepted": counts.get("accepted", 0), "compactions": counts.get("compactions", 0),
         "captures_timed": counts.get("captures", 0), "graphs": len(engine.graphs), "use_graphs": engine.use_graphs,
         "kernels": engine.kernels}
    r["accepted_per_drafted"] = r["accepted"] / r["drafted"] if r["drafted"] else None
    observed = getattr(sources[-1], "observed_acceptance", None)  # the oracle's per-token acceptance
    r["oracle_acceptance_observed"] = observed() if observed is not None else None
    # draws whose logits were not finite (the oracle's share is then not A): counted over both calls
    r["oracle_nonfinite_draws"] = processor.nonfinite() if hasattr(processor, "nonfinite") else None
    r.update(traces.live_rows_profile(made, timeline))
    return r


def ragged_arms(scheme: str, args) -> list[tuple[bool, int, float | None]]:
    """(speculative, speculative rows, acceptance) of each arm of a scheme: plain first, then each speculative one."""
    accs = [float(a) for a in args.acceptance.split(",") if a]
    arms = [(False, 0, accs[0] if accs else None)]
    spec_schemes = [x for x in args.speculative_schemes.split(",") if x]
    if "on" in args.speculative.split(",") and (not spec_schemes or scheme in spec_schemes):
        for entry in args.speculative_rows.split(","):  # ROWS, or ROWS@A/A...: at these acceptances only
            rows, _, own = entry.partition("@")
            arms += [(True, int(rows), a) for a in ([float(x) for x in own.split("/")] if own else accs or [None])]
    return arms


def arm_label(label: str, speculative: bool, rows: int, acceptance: float | None) -> str:
    if not speculative:
        return label + (f", plain (oracle A={acceptance:g})" if acceptance is not None else "")
    return label + f", speculative (<= {rows} rows" + (f", A={acceptance:g})" if acceptance is not None else ")")


def built_models(args, skipped: list[str], left):
    """(name, scheme, model, build seconds, GiB) for every --models x --schemes arm the budget leaves time for (a
    scheme that cannot be built here, the QLoRA arm without bitsandbytes, is skipped and named). The caller drops its
    `model` before asking for the next; its memory is handed back here first."""
    for name in args.models.split(","):
        for scheme in args.schemes.split(","):
            if left() < 30:
                skipped.append(f"{name} {scheme} (budget)")
                continue
            t0 = time.perf_counter()
            try:
                model = build_model(name, scheme, lora_epilogue=args.lora_epilogue, device=DEVICE,
                                    fuse=DEVICE == "cuda")
            except ImportError as e:  # the QLoRA arm without bitsandbytes: the other arms still run
                print(f"[{name} {scheme}] skipped: {e}", flush=True)
                skipped.append(f"{name} {scheme} ({e})")
                continue
            build_s, gib = time.perf_counter() - t0, allocated_gib()
            print(f"[{name} {scheme}] built in {build_s:.1f} s, {gib:.1f} GiB", flush=True)
            yield name, scheme, model, build_s, gib
            del model
            free_cuda()
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()


def run_ragged(args, log, rows: list[dict], skipped: list[str], left) -> None:
    """The `--lengths` benchmark: every scheme's engine on every trace and batch, plain and speculative arms."""
    specs = [x for x in args.lengths.split(",") if x]
    batches = [int(b) for b in args.batches.split(",")]
    scale = int(args.new.split(",")[0]) if args.new else None
    cap = max(scale or traces.trace(spec, 1).cap for spec in specs)
    last: dict[tuple, float] = {}  # (model, trace, batch) -> the slowest timed seconds so far (the budget's guide)
    for name, scheme, model, _, gib in built_models(args, skipped, left):
        vocab = model.config.vocab_size
        eos = vocab - 1  # bench_grpo_step's numbered tokenizer's end token
        for kv in args.kv.split(","):
            label = LABELS[scheme] + KV_LABELS[kv]
            # One engine for every arm: the speculative ones switch it on (as `rollout.speculative` builds it) over
            # the same cache and graphs; its slots leave room for a verify step's queries
            engine = RolloutEngine(model, kv_cache_dtype=kv, max_draft=args.max_draft,
                                   max_batch_size=max(batches), max_seq_len=args.prompt + cap + MAX_QUERIES)
            for spec in specs:
                for batch in batches:
                    trace = traces.trace(spec, batch, args.group, args.trace_seed)
                    trace = trace.scaled(scale) if scale else trace
                    prompts = group_prompts(batch, args.group, args.prompt, vocab)
                    warmed: set = set()
                    for speculative, spec_rows, acceptance in ragged_arms(scheme, args):
                        arm = arm_label(label, speculative, spec_rows, acceptance)
                        warm = (speculative, spec_rows) not in warmed or args.warmup == "every"
                        guess = last.get((name, spec, batch))
                        if guess is not None and guess * (2 if warm else 1) * 1.3 + 10 > left():
                            skipped.append(f"{name} {arm} b{batch} {trace.name} (budget)")
                            continue
                        engine.speculative, engine.speculative_rows = speculative, max(1, spec_rows)
                        if acceptance is None:
                            processor = traces.forced_eos(trace.lengths, eos, vocab, cap=trace.cap)
                            drafts = lambda: None  # noqa: E731
                        else:
                            processor = traces.oracle_policy(trace.lengths, eos, vocab, acceptance, cap=trace.cap)
                            drafts = (lambda: traces.OracleDrafts(vocab, eos)) if speculative else lambda: None
                        try:
                            r = time_ragged(engine, prompts, trace, processor, drafts, eos, warm)
                        except Exception as e:  # keep the other arms
                            print(f"  {arm} b{batch} {trace.name}: FAILED {type(e).__name__}: {e}", flush=True)
                            skipped.append(f"{name} {arm} b{batch} {trace.name} (error: {type(e).__name__})")
                            engine.free()
                            free_cuda()
                            warmed.clear()
                            continue
                        warmed.add((speculative, spec_rows))
                        last[(name, spec, batch)] = max(r["seconds"], last.get((name, spec, batch), 0.0))
                        stats = trace.stats()
                        r.update(model=name, engine=arm, scheme=scheme, kv=kv, batch=batch, new=trace.cap,
                                 prompt=args.prompt, group_size=args.group, trace=trace.name,
                                 trace_seed=args.trace_seed, speculative=speculative,
                                 speculative_rows=spec_rows if speculative else None,
                                 max_draft=args.max_draft if speculative else None, acceptance=acceptance,
                                 trace_median=stats["median"], trace_mean=stats["mean"],
                                 trace_truncated_share=stats["truncated_share"], weights_gib=gib,
                                 peak_gib=allocated_gib(peak=True), kv_gib=engine.memory_bytes() / 2**30)
                        rows.append(r)
                        log.write(json.dumps(r) + "\n")
                        log.flush()
                        spec_note = (f", accepted {r['accepted']}/{r['drafted']} in "
                                     f"{r['verify_steps']} verify steps" if speculative else "")
                        print(f"  {arm} b{batch} {trace.name}: {r['useful_tokens_per_s']:,.0f} useful tok/s "
                              f"({r['seconds']:.2f} s, {r['tokens']:,} tokens, warm-up {r['warmup_s']:.1f} s; "
                              f"steps <8 live {r['decode_step_share_below8']:.0%}, wall <8 live "
                              f"{r['wall_share_below8']:.0%}{spec_note}; exact lengths {r['lengths_exact']})",
                              flush=True)
            engine.free()
            del engine
        del model  # built_models hands its memory back before the next


def ragged_table(rows: list[dict]) -> str:
    lines = ["| model | trace | engine | rows | useful tok/s | s | steps <8 live | wall <8 live | accepted/drafted | "
             "vs plain | NVFP4 vs bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    plain = {(r["model"], r["scheme"], r["kv"], r["trace"], r["batch"]): r["useful_tokens_per_s"]
             for r in rows if not r["speculative"]}
    for r in rows:
        key = (r["model"], r["scheme"], r["kv"], r["trace"], r["batch"])
        vs_plain = f"{r['useful_tokens_per_s'] / plain[key]:.2f}x" if r["speculative"] and key in plain else "-"
        bf16 = plain.get((r["model"], "bf16", r["kv"], r["trace"], r["batch"]))
        vs_bf16 = f"{r['useful_tokens_per_s'] / bf16:.2f}x" if bf16 and not r["speculative"] and r["scheme"] != "bf16" \
            else "-"
        acc = f"{r['accepted_per_drafted']:.2f}" if r.get("accepted_per_drafted") is not None else "-"
        lines.append(f"| {r['model']} | {r['trace']} | {r['engine']} | {r['batch']} | "
                     f"{r['useful_tokens_per_s']:,.0f} | {r['seconds']:.2f} | {r['decode_step_share_below8']:.0%} | "
                     f"{r['wall_share_below8']:.0%} | {acc} | {vs_plain} | {vs_bf16} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| model | engine | batch | new tokens | tokens/s | s | vs bf16+LoRA | vs QLoRA | capture s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def speeds(label: str) -> dict:
        return {(r["model"], r["batch"], r["new"]): r["tokens_per_s"] for r in rows if r["engine"] == label}

    bf16, qlora = speeds(LABELS["bf16"]), speeds(LABELS["nf4-bnb"])

    def ratio(r: dict, ref: dict) -> str:
        base = ref.get((r["model"], r["batch"], r.get("new")))
        return f"{r['tokens_per_s'] / base:.2f}x" if base else "-"

    for r in rows:
        lines.append(f"| {r['model']} | {r['engine']} | {r['batch']} | {r['new']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['seconds']:.2f} | {ratio(r, bf16)} | {ratio(r, qlora)} | {r.get('capture_s', 0):.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b,32b")
    ap.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES), help=f"of {', '.join(SCHEMES)}")
    ap.add_argument("--batches", default="8,32,64,128")
    ap.add_argument("--new", default=None, help="new tokens per row (default 256,1024); with --lengths: the trace "
                    "scaled to this cap (default: the trace's own cap)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--hf", action="store_true", help="also time HF generate (first model, batch 64)")
    ap.add_argument("--hf-new", type=int, default=64)
    ap.add_argument("--plain", action="store_true", help="also the unfused path (graphs of Transformer.forward)")
    ap.add_argument("--separate", action="store_true",
                    help="also each scheme with separate q/k/v and gate/up projections (batch 8 and 64)")
    ap.add_argument("--kv", default="model", help="rollout.kv_cache_dtype values, each an engine per scheme "
                    "(model,fp8: both)")
    ap.add_argument("--long-batches", default="", help="batches for the largest --new (default: all)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; configs that would not fit are skipped")
    ap.add_argument("--lora-epilogue", action="store_true", help="execution.lora_epilogue: LoRA in the GEMM epilogue")
    ap.add_argument("--out", default="outputs/bench")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for dry runs (--models tiny)")
    ap.add_argument("--lengths", default="", help="ragged rollouts: completion-length traces, comma-separated, each a "
                    f"preset ({', '.join(traces.PRESETS)}) or a FILE of lengths (benchmarks/lengths.py); default: "
                    "every row runs to --new")
    ap.add_argument("--group", type=int, default=8, help="with --lengths: rows per prompt (a GRPO group)")
    ap.add_argument("--trace-seed", type=int, default=0, help="with --lengths: the preset draw's seed")
    ap.add_argument("--speculative", default="off", help="with --lengths: off, on or off,on (plain and speculative "
                    "arms)")
    ap.add_argument("--speculative-rows", default="8", help="live rows at which speculation starts, comma-separated: "
                    "an arm at each --acceptance for each, or ROWS@A/A/...: at those acceptances only")
    ap.add_argument("--speculative-schemes", default="", help="schemes with speculative arms (default: all)")
    ap.add_argument("--max-draft", type=int, default=7)
    ap.add_argument("--acceptance", default="", help="with --lengths: the oracle policy's acceptance per drafted "
                    "token, comma-separated (an arm each); default: no oracle")
    ap.add_argument("--warmup", choices=("first", "every"), default="first", help="with --lengths: an untimed call "
                    "before an engine's first plain / first speculative call of a trace, or before every call")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    from qerl.kernels import nvfp4_ops

    where = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"device {where} | torch {torch.__version__} | NVFP4 Triton kernels "
          f"{'available' if nvfp4_ops.available() else 'NOT available (PyTorch dequantize path)'} | "
          f"bitsandbytes {bnb_version()}", flush=True)
    rows: list[dict] = []
    skipped: list[str] = []
    if args.lengths:
        with open(os.path.join(args.out, "rollout.jsonl"), "a") as log:
            run_ragged(args, log, rows, skipped, left)
        print("\n" + ragged_table(rows))
        if skipped:
            print("\nnot run: " + "; ".join(skipped))
        return
    batches = [int(b) for b in args.batches.split(",")]
    news = [int(n) for n in (args.new or "256,1024").split(",")]
    long_batches = [int(b) for b in args.long_batches.split(",")] if args.long_batches else batches
    configs = [(b, n) for n in news for b in (long_batches if n == max(news) and len(news) > 1 else batches)]
    # Most important first (the targets are at batch 64), so a short budget still measures them.
    order = sorted(configs, key=lambda bn: (bn[0] != 64, bn[1], bn[0]))
    with open(os.path.join(args.out, "rollout.jsonl"), "a") as log:
        for name, scheme, model, _, gib in built_models(args, skipped, left):
            variants = [(LABELS[scheme] + KV_LABELS[kv], True, order, kv) for kv in args.kv.split(",")]
            if args.plain and scheme == "bf16":
                variants.append(("qerl bf16+LoRA, unfused", False, [(64, news[0])], "model"))
            if args.separate and scheme != "nf4-bnb":  # bitsandbytes layers are never fused
                variants.append((LABELS[scheme] + ", separate projections", True,
                                 [(b, news[0]) for b in (8, 64) if b in batches], "model"))
            per_step = 0.0  # slowest seconds per decode step so far, to predict whether a config fits
            for label, fused, configs_run, kv in variants:
                if label.endswith("separate projections"):
                    from qerl.execution.fusion import unfuse_projections

                    unfuse_projections(model)
                engine = RolloutEngine(model, fused=fused, kv_cache_dtype=kv)
                for batch, new in configs_run:
                    if per_step * new * 1.6 + 5 > left():
                        skipped.append(f"{name} {label} b{batch} x{new} (budget)")
                        continue
                    try:
                        r = time_engine(engine, batch, args.prompt, new, model.config.vocab_size)
                    except Exception as e:  # keep the other configs
                        print(f"  {label} b{batch} x{new}: FAILED {type(e).__name__}: {e}", flush=True)
                        skipped.append(f"{name} {label} b{batch} x{new} (error: {type(e).__name__})")
                        engine.free()
                        free_cuda()
                        engine = RolloutEngine(model, fused=fused, kv_cache_dtype=kv)
                        continue
                    per_step = max(per_step, r["seconds"] / new)
                    r.update(model=name, engine=label, batch=batch, new=new, prompt=args.prompt,
                             weights_gib=gib, peak_gib=allocated_gib(peak=True),
                             kv_gib=engine.memory_bytes() / 2**30)
                    rows.append(r)
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                    print(f"  {label} b{batch} x{new}: {r['tokens_per_s']:,.0f} tok/s ({r['seconds']:.2f} s, "
                          f"capture {r['capture_s']:.1f} s, graphs={r['use_graphs']}, "
                          f"fused kernels={r['kernels']})", flush=True)
                engine.free()
            del model, engine  # built_models hands its memory back before the next
        if args.hf:
            name = args.models.split(",")[0]
            if left() > 40:
                try:
                    r = hf_anchor(name, 64, args.prompt, args.hf_new)
                    r.update(model=name, engine="HF generate bf16 (eager)", batch=64, prompt=args.prompt)
                    rows.append(r)
                    log.write(json.dumps(r) + "\n")
                    print(f"  HF generate b64 x{r['new']}: {r['tokens_per_s']:,.0f} tok/s", flush=True)
                except Exception as e:
                    print(f"  HF anchor FAILED {type(e).__name__}: {e}", flush=True)
            else:
                skipped.append("HF anchor (budget)")
    print("\n" + table(rows))
    if skipped:
        print("\nnot run: " + "; ".join(skipped))


if __name__ == "__main__":
    main()
