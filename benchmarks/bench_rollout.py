"""Rollout throughput of qerl's engine (bf16+LoRA, NVFP4+LoRA, and QLoRA: bitsandbytes NF4+LoRA) on random-weight
Qwen2.5 shapes (and one row per other family: mistral-7b, phi4-14b, gemma3-4b, gemma3-12b), with Hugging Face
`generate` (bf16, eager) as the outside anchor.

    PYTHONPATH=. python3 benchmarks/bench_rollout.py --models 7b,32b --batches 8,32,64,128 --new 256,1024 \
        [--schemes bf16,nvfp4,nf4-bnb] [--long-batches 64] [--hf] [--plain] --out DIR [--budget SECONDS]

The nf4-bnb arm (quant.scheme nf4-bnb: bitsandbytes' Linear4bit storage and `matmul_4bit`, as TRL and Unsloth run
QLoRA) needs bitsandbytes (`pip install -e ".[qlora]"`); without it that arm is skipped and named at the end.

Every row generates exactly `new` tokens (EOS ignored), from 256-token random prompts, temperature 1. Tokens/s =
batch * new / wall time of one `RolloutEngine.generate` call, prefill included, after `engine.prepare` (graph
capture is a one-off per engine, reported separately). Results: DIR/rollout.jsonl and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qerl.execution import ExecutionPlan, attach  # noqa: E402
from qerl.model.lora import LoraSettings, apply_lora  # noqa: E402
from qerl.model.transformer import DecoderLayer, ModelConfig, RMSNorm, Transformer  # noqa: E402
from qerl.quant.bnb import quantize_model_bnb, require_bitsandbytes  # noqa: E402
from qerl.quant.linear import plan_fp8_weights, quantize_model  # noqa: E402
from qerl.rollout.engine import RolloutEngine  # noqa: E402

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
# nvfp4 is the product's default (quant.fp8_weights: auto, a resident FP8 copy where it fits); nvfp4-4bit the same
# base with quant.fp8_weights: false (the 4-bit weights alone, as before #45).
SCHEMES = ("bf16", "nvfp4", "nvfp4-4bit", "nf4-bnb")
LABELS = {"bf16": "qerl bf16+LoRA", "nvfp4": "qerl NVFP4+LoRA", "nvfp4-4bit": "qerl NVFP4+LoRA, 4-bit only",
          "nf4-bnb": "qerl bnb-NF4+LoRA (QLoRA)"}


KV_LABELS = {"model": "", "fp8": ", FP8 KV"}


def hf_config(name: str) -> dict:
    return {"model_type": "qwen2", "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "tie_word_embeddings": False, **SHAPES[name]}


@torch.no_grad()
def build_model(name: str, scheme: str, lora_rank: int = 16, device: str = "cuda", seed: int = 0,
                fuse: bool = True, lora_epilogue: bool = False) -> Transformer:
    """Random-weight model of a published shape, bf16, decoder linears in `scheme` (one of SCHEMES), LoRA on
    all of them, q/k/v and gate/up fused as `load_base_model` does on CUDA (`fuse`). Built layer by layer (each
    quantized as soon as it exists), so a 32B model never sits in bf16 on the GPU: peak = the quantized model + one
    bf16 layer. Its execution plan: the defaults (eager training ops), with `lora_epilogue`
    (execution.lora_epilogue)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    fp8_weights = "auto" if scheme == "nvfp4" else False  # quant.fp8_weights, as prepare_base plans it
    scheme = "nvfp4" if scheme == "nvfp4-4bit" else scheme
    if scheme == "nf4-bnb":
        require_bitsandbytes()  # one line saying how to install it, before any GPU memory is touched
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
                if scheme == "nvfp4":
                    quantize_model(layer, "nvfp4", pattern=r".")  # q/k/v and gate/up share global scales
                elif scheme == "nf4-bnb":
                    quantize_model_bnb(layer, pattern=r".")  # bitsandbytes' quantize_4bit, on the GPU
                model.model.layers[i] = layer
    finally:
        torch.set_default_dtype(previous)
    model.model.rotary_emb.to_empty(device=device)  # recomputes inv_freq on the device
    model.requires_grad_(False)  # a frozen base, as load_base_model leaves it (bf16 weights fuse only when frozen)
    if lora_rank:
        params = apply_lora(model, LoraSettings(rank=lora_rank, alpha=2 * lora_rank), dtype=torch.bfloat16)
        for p in params:
            if p.dim() == 2 and p.shape[1] == lora_rank:  # lora_B: non-zero so the update path does real work
                p.normal_(0, 1e-3)
    plan_fp8_weights(model, fp8_weights, torch.device(device))  # before fusing, as prepare_base
    if fuse:
        model.fuse_projections()
    attach(model, ExecutionPlan(lora_epilogue=lora_epilogue))  # one GEMM context for the layers built one by one
    return model.eval()


def bnb_version() -> str:
    try:
        return require_bitsandbytes().__version__
    except ImportError:
        return "not installed (the nf4-bnb arm is skipped)"


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


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
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(None, prompts, new, temperature=1.0, eos_token_ids=[], seed=0)
    torch.cuda.synchronize()
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
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--batches", default="8,32,64,128")
    ap.add_argument("--new", default="256,1024")
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
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    from qerl.kernels import nvfp4_ops

    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | NVFP4 Triton kernels "
          f"{'available' if nvfp4_ops.available() else 'NOT available (PyTorch dequantize path)'} | "
          f"bitsandbytes {bnb_version()}", flush=True)
    rows: list[dict] = []
    skipped: list[str] = []
    batches = [int(b) for b in args.batches.split(",")]
    news = [int(n) for n in args.new.split(",")]
    long_batches = [int(b) for b in args.long_batches.split(",")] if args.long_batches else batches
    configs = [(b, n) for n in news for b in (long_batches if n == max(news) and len(news) > 1 else batches)]
    # Most important first (the targets are at batch 64), so a short budget still measures them.
    order = sorted(configs, key=lambda bn: (bn[0] != 64, bn[1], bn[0]))
    with open(os.path.join(args.out, "rollout.jsonl"), "a") as log:
        for name in args.models.split(","):
            for scheme in args.schemes.split(","):
                if left() < 30:
                    skipped.append(f"{name} {scheme} (budget)")
                    continue
                t0 = time.perf_counter()
                try:
                    model = build_model(name, scheme, lora_epilogue=args.lora_epilogue)
                except ImportError as e:  # the QLoRA arm without bitsandbytes: the other arms still run
                    print(f"[{name} {scheme}] skipped: {e}", flush=True)
                    skipped.append(f"{name} {scheme} ({e})")
                    continue
                build_s = time.perf_counter() - t0
                gib = torch.cuda.memory_allocated() / 2**30
                print(f"[{name} {scheme}] built in {build_s:.1f} s, {gib:.1f} GiB", flush=True)
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
                                 weights_gib=gib, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                                 kv_gib=engine.memory_bytes() / 2**30)
                        rows.append(r)
                        log.write(json.dumps(r) + "\n")
                        log.flush()
                        print(f"  {label} b{batch} x{new}: {r['tokens_per_s']:,.0f} tok/s ({r['seconds']:.2f} s, "
                              f"capture {r['capture_s']:.1f} s, graphs={r['use_graphs']}, "
                              f"fused kernels={r['kernels']})", flush=True)
                    engine.free()
                del model, engine
                free_cuda()
                torch.cuda.reset_peak_memory_stats()
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
