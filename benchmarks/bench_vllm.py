"""qerl's rollout engine beside vLLM, the engine NVlabs/QeRL, TRL, Unsloth and verl roll out with: bf16 + LoRA and
NVFP4 + LoRA on each side, random-weight Qwen2.5 shapes, the same prompts and lengths, each arm in its own process.

    PYTHONPATH=. python3 benchmarks/bench_vllm.py --model 7b --rows 1,8,64,128,256 --new 1024 --long 64x4096 \
        --arms vllm-bf16,vllm-nvfp4,qerl-bf16,qerl-nvfp4 --folder /tmp/qerl-vllm-7b --out DIR

vLLM's arms load a folder this script writes once (`--folder`): a random bf16 Hugging Face checkpoint of the shape,
its NVFP4 form written by qerl's own `quantize_checkpoint` (compressed-tensors `nvfp4-pack-quantized`, which vLLM
runs with its Marlin FP4 kernels on Hopper), and a random rank-16 PEFT adapter on all seven projections. With
`--weights dummy` (the 32B: its bf16 checkpoint, 65 GB, does not fit a 64 GB disk beside its NVFP4 form) the two
model folders hold only their config.json, the NVFP4 one with the quantization_config `quantize_checkpoint` writes,
and vLLM makes up the weights (`load_format="dummy"`: small uniform values; speed does not depend on them). vLLM runs as
users run it offline: `LLM(...)` with its defaults (torch.compile, piecewise CUDA graphs, FlashAttention 3 on
Hopper), LoRA enabled, the engine core in this process, `gpu_memory_utilization` 0.85. qerl's arms run
`benchmarks/bench_rollout.py`'s model (the same shape built in memory, `quant.fp8_weights: auto` for NVFP4) through
`RolloutEngine`, as `qerl train` does.

Every row samples exactly `new` tokens (EOS ignored, temperature 1) from 256-token random prompts. Tokens/s = rows *
new / wall time of one generate call of all rows, prefill included, after a warm-up call (vLLM: its compile and graph
capture at start; qerl: `engine.prepare`); both are reported apart. Results: DIR/vllm.jsonl, a table on stdout.

Ragged rollouts (`--lengths PRESET|FILE[,...]`, `benchmarks/lengths.py`, replacing --new and --long): the same
trace on both sides, drawn per group of `--group` rows sharing one random prompt. vLLM has no logits processor of
ours, so its rows get the ragged shape from per-request `max_tokens` = `min_tokens` = the row's traced length with
`ignore_eos=True`; qerl's rows end at theirs by forced EOS (`lengths.forced_eos`, as `bench_rollout.py --lengths`),
rows at the trace's cap running to it on both sides. Tokens/s = the completions' tokens / wall time; both sides run
the identical call once untimed first (graphs for every bucket the ragged batch reaches). Rows add the trace, the
share of decode steps below 8 live rows (exact, from the lengths) and, for qerl, of wall time (its timeline).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

ARMS = ("vllm-bf16", "vllm-nvfp4", "qerl-bf16", "qerl-nvfp4")
LORA_RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------------------------- the folder
def model_config(model: str) -> dict:
    """The Hugging Face config.json of a random-weight model of `model`'s published shape."""
    from bench_rollout import hf_config

    return {**hf_config(model), "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "attention_dropout": 0.0}


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection of a block: the weights, and the adapter on all seven."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    return {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
            "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i)}


def write_config_folders(cfg: dict, folder: Path) -> None:
    """`folder`/bf16 and `folder`/nvfp4 as config.json alone (vLLM's `load_format="dummy"` makes up the weights); the
    NVFP4 one declares what `quantize_checkpoint` would write for this config: the same quantization_config."""
    from qerl.quant.checkpoint import quantization_config

    for scheme in ("bf16", "nvfp4"):
        (folder / scheme).mkdir(parents=True, exist_ok=True)
        qc = quantization_config(scheme)
        (folder / scheme / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})},
                                                                indent=2, sort_keys=True))


def write_folder(model: str, folder: Path, weights: str = "random") -> None:
    """`folder`/bf16 (random weights), `folder`/nvfp4 (qerl's quantize_checkpoint of it), `folder`/lora (PEFT);
    with `weights` "dummy", the same under `folder`/dummy, the two model folders as config.json alone
    (write_config_folders)."""
    import torch
    from safetensors.torch import save_file

    from qerl.quant.checkpoint import quantize_checkpoint

    if weights == "dummy":  # a folder of its own: never mistaken for (or mixed into) the random checkpoint's
        folder = folder / "dummy"
    done = folder / "done"
    if done.is_file():
        return
    t0 = time.perf_counter()
    cfg = model_config(model)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    shapes = projection_shapes(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, std):
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16).cpu()
    if weights == "dummy":
        write_config_folders(cfg, folder)
        write_adapter(folder / "lora", folder / "bf16", shapes, n_layers, rand)
        done.write_text("ok")
        return
    bf16 = folder / "bf16"
    bf16.mkdir(parents=True, exist_ok=True)
    index, shard, shard_no, size = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_no, size
        if shard:
            name = f"model-{shard_no:05d}.safetensors"
            save_file(shard, str(bf16 / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, shard_no, size = {}, shard_no + 1, 0

    def add(name, t):
        nonlocal size
        shard[name] = t
        size += t.numel() * 2
        if size > 4 << 30:
            flush()

    add("model.embed_tokens.weight", rand(cfg["vocab_size"], h, std=1.0))
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        for name, (out_f, in_f) in shapes.items():
            add(p + name + ".weight", rand(out_f, in_f, std=in_f ** -0.5))
        for name in ("q_proj", "k_proj", "v_proj"):
            add(p + f"self_attn.{name}.bias", rand(shapes[f"self_attn.{name}"][0], std=0.02))
        add(p + "input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16))
        add(p + "post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16))
    add("model.norm.weight", torch.ones(h, dtype=torch.bfloat16))
    add("lm_head.weight", rand(cfg["vocab_size"], h, std=h ** -0.5))
    flush()
    (bf16 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (bf16 / "config.json").write_text(json.dumps(cfg))
    print(f"bf16 folder written in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    quantize_checkpoint(bf16, folder / "nvfp4", "nvfp4", progress=False)
    print(f"nvfp4 folder written in {time.perf_counter() - t0:.0f} s", flush=True)
    write_adapter(folder / "lora", bf16, shapes, n_layers, rand)
    done.write_text("ok")


def write_adapter(lora: Path, base: Path, shapes: dict, n_layers: int, rand) -> None:
    """A random rank-LORA_RANK PEFT adapter on all seven projections of every block (lora_B small, not zero: the
    adapter's GEMMs run as a trained one's do)."""
    from safetensors.torch import save_file

    lora.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(n_layers):
        for name, (out_f, in_f) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = rand(LORA_RANK, in_f, std=in_f ** -0.5)
            tensors[f"{key}.lora_B.weight"] = rand(out_f, LORA_RANK, std=1e-3)
    save_file(tensors, str(lora / "adapter_model.safetensors"), metadata={"format": "pt"})
    (lora / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "target_modules": list(PROJECTIONS),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base)}))


# ---------------------------------------------------------------------------------------------------------- the arms
def configs(args) -> list[tuple[int, int]]:
    """(rows, new) of each call; with --lengths, (rows, the trace's cap)."""
    if args.lengths:
        return [(batch, trace.cap) for batch, trace in ragged_configs(args)]
    out = [(int(r), args.new) for r in args.rows.split(",") if r]
    out += [tuple(int(x) for x in c.split("x")) for c in args.long.split(",") if c]
    return out


def ragged_configs(args) -> list:
    """(rows, lengths.Trace) of each call with --lengths: every trace at every --rows."""
    import lengths as traces

    return [(int(b), traces.trace(spec, int(b), args.group, args.trace_seed))
            for spec in args.lengths.split(",") if spec for b in args.rows.split(",") if b]


def ragged_fields(trace) -> dict:
    stats = trace.stats()
    return {"trace": trace.name, "trace_median": stats["median"], "trace_truncated_share": stats["truncated_share"],
            "tokens": stats["tokens"], "decode_step_share_below8": stats["decode_step_share_below8"]}


def vllm_arm(args, scheme: str) -> list[dict]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from bench_rollout import random_prompts

    import vllm
    folder = Path(args.folder) / ("dummy" if args.weights == "dummy" else "")
    longest = max(n for _, n in configs(args))
    t0 = time.perf_counter()
    llm = LLM(model=str(folder / scheme), skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_lora=True,
              max_lora_rank=LORA_RANK, max_loras=1, max_model_len=args.prompt + longest,
              max_num_seqs=max(r for r, _ in configs(args)), gpu_memory_utilization=args.gpu_memory_utilization,
              load_format="dummy" if args.weights == "dummy" else "auto")
    start_s = time.perf_counter() - t0
    lora = LoRARequest("bench", 1, str(folder / "lora"))
    free, total = torch.cuda.mem_get_info()
    vocab = json.loads((folder / "bf16" / "config.json").read_text())["vocab_size"]
    rows = []
    if args.lengths:
        from bench_rollout import group_prompts

        for batch, trace in ragged_configs(args):
            # Each request's own length: max_tokens = min_tokens = the row's traced length, EOS ignored
            params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, detokenize=False)
                      for n in trace.lengths]
            prompts = [{"prompt_token_ids": p} for p in group_prompts(batch, args.group, args.prompt, vocab)]
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=lora)  # warm-up: the identical call
            torch.cuda.synchronize()
            warmup_s = time.perf_counter() - t
            t = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t
            made = [len(o.outputs[0].token_ids) for o in out]
            rows.append({"engine": f"vLLM {vllm.__version__} {scheme}+LoRA", "batch": batch, "new": trace.cap,
                         "seconds": seconds, "tokens_per_s": sum(made) / seconds, "start_s": start_s,
                         "warmup_s": warmup_s, "held_gib": (total - free) / 2**30,
                         "lengths_exact": made == list(trace.lengths), **ragged_fields(trace)})
            print(f"  {rows[-1]['engine']} b{batch} {trace.name}: {rows[-1]['tokens_per_s']:,.0f} useful tok/s",
                  flush=True)
        return rows
    for batch, new in configs(args):
        # No per-request seed: vLLM 0.26 draws a seeded request's noise row by row, a kernel launch per row per
        # step ("This can be slow", its sampler says); the LLM's own seed keeps the run reproducible, as TRL runs it.
        params = SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, args.prompt, vocab)]
        llm.generate(prompts[: min(batch, 8)], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
                     use_tqdm=False, lora_request=lora)  # warm-up: the adapter loaded, the batch's graphs used once
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new for o in out)
        rows.append({"engine": f"vLLM {vllm.__version__} {scheme}+LoRA", "batch": batch, "new": new,
                     "seconds": seconds, "tokens_per_s": batch * new / seconds, "start_s": start_s,
                     "held_gib": (total - free) / 2**30})
        print(f"  {rows[-1]['engine']} b{batch} x{new}: {rows[-1]['tokens_per_s']:,.0f} tok/s", flush=True)
    return rows


def qerl_arm(args, scheme: str) -> list[dict]:
    import torch

    import bench_rollout
    from bench_rollout import allocated_gib, build_model, group_prompts, time_engine, time_ragged
    from qerl.rollout.engine import RolloutEngine

    bench_rollout.DEVICE = args.device
    t0 = time.perf_counter()
    model = build_model(args.model, scheme, lora_rank=LORA_RANK, device=args.device, fuse=args.device == "cuda")
    start_s = time.perf_counter() - t0
    weights = allocated_gib()
    engine = RolloutEngine(model)
    rows = []
    if args.lengths:
        import lengths as traces

        vocab = model.config.vocab_size
        eos = vocab - 1
        for batch, trace in ragged_configs(args):
            processor = traces.forced_eos(trace.lengths, eos, vocab, cap=trace.cap)
            prompts = group_prompts(batch, args.group, args.prompt, vocab)
            r = time_ragged(engine, prompts, trace, processor, lambda: None, eos, warm_up=True)
            rows.append({"engine": f"qerl {scheme}+LoRA", "batch": batch, "new": trace.cap, "seconds": r["seconds"],
                         "tokens_per_s": r["useful_tokens_per_s"], "start_s": start_s, "warmup_s": r["warmup_s"],
                         "held_gib": allocated_gib(peak=True), "weights_gib": weights,
                         "lengths_exact": r["lengths_exact"], "wall_share_below8": r["wall_share_below8"],
                         **ragged_fields(trace)})
            print(f"  {rows[-1]['engine']} b{batch} {trace.name}: {r['useful_tokens_per_s']:,.0f} useful tok/s "
                  f"(warm-up {r['warmup_s']:.1f} s, wall <8 live {r['wall_share_below8']:.0%})", flush=True)
        return rows
    for batch, new in configs(args):
        r = time_engine(engine, batch, args.prompt, new, model.config.vocab_size)
        rows.append({"engine": f"qerl {scheme}+LoRA", "batch": batch, "new": new, "seconds": r["seconds"],
                     "tokens_per_s": r["tokens_per_s"], "start_s": start_s + r["capture_s"],
                     "held_gib": torch.cuda.max_memory_allocated() / 2**30, "weights_gib": weights})
        print(f"  {rows[-1]['engine']} b{batch} x{new}: {rows[-1]['tokens_per_s']:,.0f} tok/s "
              f"(capture {r['capture_s']:.1f} s)", flush=True)
    return rows


def run_arm(args) -> None:
    side, scheme = args.arm.split("-", 1)
    rows = vllm_arm(args, scheme) if side == "vllm" else qerl_arm(args, scheme)
    with open(os.path.join(args.out, "vllm.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "arm": args.arm, "model": args.model, "prompt": args.prompt,
                                "weights": args.weights, "group_size": args.group}) + "\n")


# --------------------------------------------------------------------------------------------------------- the table
def table(rows: list[dict]) -> str:
    # a call is (rows, new) at fixed lengths, (rows, new, trace) on a trace (tokens/s: the completions' tokens)
    by = {(r["arm"], r["batch"], r["new"], r.get("trace")): r for r in rows}
    keys = sorted({(r["batch"], r["new"], r.get("trace")) for r in rows}, key=lambda k: (k[2] or "", k[1], k[0]))
    out = ["| rows x new | " + " | ".join(a for a in ARMS) + " | qerl/vLLM bf16 | qerl/vLLM NVFP4 |",
           "|---" * (len(ARMS) + 3) + "|"]
    for b, n, t in keys:
        cells = [f"{by[(a, b, n, t)]['tokens_per_s']:,.0f}" if (a, b, n, t) in by else "-" for a in ARMS]

        def ratio(fmt):
            ours, theirs = by.get((f"qerl-{fmt}", b, n, t)), by.get((f"vllm-{fmt}", b, n, t))
            return f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x" if ours and theirs else "-"
        shape = f"{b} x {n}" if t is None else f"{b} x {t} (cap {n})"
        out.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio('bf16')} | {ratio('nvfp4')} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--rows", default="1,8,64,128,256")
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--long", default="64x4096", help="extra rows x new configs, comma-separated")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in this process (the parent's child)
    ap.add_argument("--folder", default="/tmp/qerl-vllm-bench")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--weights", choices=("random", "dummy"), default="random",
                    help="vLLM's weights: a random checkpoint written to --folder, or made up by vLLM (config only)")
    ap.add_argument("--lengths", default="", help="ragged calls: completion-length traces, comma-separated (presets of "
                    "benchmarks/lengths.py or FILEs), each at every --rows (instead of --new and --long)")
    ap.add_argument("--group", type=int, default=8, help="with --lengths: rows per prompt (a GRPO group)")
    ap.add_argument("--trace-seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="qerl's arms: cuda, or cpu for dry runs (--model tiny)")
    ap.add_argument("--out", default="outputs/bench")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.arm:
        return run_arm(args)
    arms = args.arms.split(",")
    skipped = []
    if importlib.util.find_spec("vllm") is None:  # its arms are named at the end; ours still run
        skipped = [f"{a} (vLLM is not installed)" for a in arms if a.startswith("vllm")]
        arms = [a for a in arms if not a.startswith("vllm")]
    if any(a.startswith("vllm") for a in arms):
        write_folder(args.model, Path(args.folder), args.weights)
    for arm in arms:
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, *sys.argv[1:], "--arm", arm]
        with open(os.path.join(args.out, f"{arm}.log"), "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        tail = Path(args.out, f"{arm}.log").read_text().splitlines()[-12:]
        print(f"[{arm}] rc={rc} in {time.perf_counter() - t0:.0f} s\n  " + "\n  ".join(tail), flush=True)
    path = os.path.join(args.out, "vllm.jsonl")
    rows = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
    print("\n" + table(rows))
    if skipped:
        print("\nnot run: " + "; ".join(skipped))


if __name__ == "__main__":
    main()
