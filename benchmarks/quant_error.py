"""Why NVFP4 differs from NF4 on the embedded SmolLM2-135M (issue #63, part 1), measured on the CPU.

    python benchmarks/quant_error.py --out docs/quant_error            # ~10 minutes on 2 busy cores
    python benchmarks/quant_error.py --out docs/quant_error --remedies  # part 2b for issue #63's remedy arms

For every base format qerl has (`qerl.quant.SCHEMES`: bf16, nf4, nvfp4, mxfp4; plus FP8 E4M3 with one scale per
output row, what `model.base_gemm: fp8` computes with, and bitsandbytes' NF4 where it imports) it writes to --out:

1. **Weights**, per layer and projection: relative error ||W_q - W|| / ||W||; the error's mean over its std (a
   bias?); the slope of W_q on W, <W_q, W> / <W, W> (< 1: the format shrinks magnitudes, > 1: grows them) and the
   correlation of the error with W.
2. **Policy**, on held-out 2-digit additions (params/compare.yaml's task, chat template and system prompt; `qerl
   eval`'s test split): the dense model's own completions, greedy and sampled (T = 1, seeded), then, teacher-forced
   along them, every format's mean next-token entropy, KL(dense || format) per token and top-1 agreement with the
   dense model.
3. **Sensitivity**: NVFP4 on one layer (all seven projections) or one projection type (all layers) at a time, the
   rest dense: KL to the dense model along its sampled completions. Which layers move the policy.
4. **Codec**: qerl's NVFP4 codec against the format's reference rounding (benchmarks/nvfp4_reference.py) and
   against compressed-tensors' own quantizer, on real SmolLM2 weights and a random one, in fp32 and bf16.

The "dense" reference is the model as the CPU runs use it (`model.dtype: auto` = fp32 on the CPU; the GGUF's weights
are Q4_1/Q8_0 values dequantized, so they are exactly representable): what the seed study calls bf16. Sample sizes are
in the JSON and the summary; every draw is seeded.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import nvfp4_reference  # noqa: E402
from qerl.quant import SCHEMES, nvfp4  # noqa: E402
from qerl.quant.linear import DECODER_LINEAR_PATTERN, QuantLinear, quantize_model  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


# ------------------------------------------------------------------------------------------------ formats


def decoder_linears(model) -> dict[str, torch.nn.Linear]:
    """The linears qerl quantizes (every projection of every decoder layer; embeddings and the tied head stay dense)."""
    import re

    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and re.search(DECODER_LINEAR_PATTERN, n)}


def qerl_format(model, scheme: str, **options) -> dict[str, torch.Tensor]:
    """name -> the fp32 weight a CPU forward multiplies with, through qerl's own `quantize_model` on a copy (so
    NVFP4's shared q/k/v and gate/up global scales are as in training); `options`: quantize_model's (layer_schemes,
    correction_rank; the correction is part of the weight a CPU forward multiplies with)."""
    twin = copy.deepcopy(model)
    quantize_model(twin, scheme, **options)
    weights = {n: m.compute_weight(torch.float32).detach().clone() for n, m in twin.named_modules()
               if isinstance(m, QuantLinear)}
    del twin
    return weights


def fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """W in E4M3 with one fp32 scale per output row (amax / 448), back to fp32: `qerl.quant.fp8`'s weight rounding."""
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def bnb_nf4(w: torch.Tensor) -> torch.Tensor | None:
    """bitsandbytes' NF4 (QLoRA: block 64, double-quantized absmax) round trip, or None where it does not import."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    import bitsandbytes.functional as F

    q, state = F.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4", compress_statistics=True)
    return F.dequantize_4bit(q, state).float()


def all_formats(model, linears: dict[str, torch.nn.Linear]) -> dict[str, dict[str, torch.Tensor]]:
    dense = {n: m.weight.detach().float() for n, m in linears.items()}
    formats = {"bf16-rounded": {n: w.to(torch.bfloat16).float() for n, w in dense.items()}}
    for scheme in SCHEMES:
        if scheme != "bf16":  # the dense reference itself
            formats[scheme] = qerl_format(model, scheme)
    formats["fp8-rows"] = {n: fp8_rows(w) for n, w in dense.items()}
    first = next(iter(dense.values()))
    if bnb_nf4(first) is not None:
        formats["nf4-bnb"] = {n: bnb_nf4(w) for n, w in dense.items()}
    return formats


def remedy_formats(model) -> dict[str, dict[str, torch.Tensor]]:
    """NVFP4 and the quantized bases of issue #63's remedy arms (flows/arms.py, the one definition of them), as
    `qerl_format` weights."""
    from qerl.config import load_settings
    from qerl.flows.arms import ARMS

    formats = {"nvfp4": qerl_format(model, "nvfp4")}
    for arm in ("nvfp4-correction", "nvfp4-fp8-sensitive"):
        quant = load_settings(None, ARMS[arm]).quant
        formats[arm] = qerl_format(model, quant.scheme, layer_schemes=quant.layer_schemes,
                                   correction_rank=quant.error_correction_rank)
    return formats


def probes(dense: dict[str, torch.Tensor], formats: dict[str, dict[str, torch.Tensor]], seed: int) -> dict:
    """Weights that separate an error's size from its structure: seeded Gaussian noise with the std of NVFP4's
    (or NF4's) own error in each matrix, and NF4 with each output row's mean error taken out (its bias)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for f in ("nvfp4", "nf4"):
        out[f"noise-like-{f}"] = {n: w + torch.randn(w.shape, generator=g) * (formats[f][n] - w).std()
                                  for n, w in dense.items()}
    out["nf4-row-debiased"] = {n: formats["nf4"][n] - (formats["nf4"][n] - w).mean(1, keepdim=True)
                               for n, w in dense.items()}
    return out


# ------------------------------------------------------------------------------------------------ 1. weights


def weight_stats(w: torch.Tensor, wq: torch.Tensor) -> dict[str, float]:
    w, e = w.flatten(), (wq - w).flatten()
    w_c, e_c = w - w.mean(), e - e.mean()
    return {
        "rel_error": float(e.norm() / w.norm()),
        "mean_over_std": float(e.mean() / e.std()),  # a bias would show as |.| >> 1/sqrt(numel) (~0.001 here)
        "slope": float(1 + (e @ w) / (w @ w)),  # least-squares gain of W_q on W, <W_q, W> / <W, W>: 1 = no shrinkage
        "corr_error_w": float((e_c @ w_c) / (e_c.norm() * w_c.norm())),
        "zero_share": float((wq == 0).double().mean()),  # weights the format rounds to exactly 0
    }


def layer_and_projection(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]), parts[-1]


# ------------------------------------------------------------------------------------------------ 2. policy


def held_out_prompts(tokenizer, n: int) -> tuple[list[str], list]:
    """The first n held-out questions of params/compare.yaml's task, as `qerl eval` builds them."""
    from qerl.config import load_settings
    from qerl.data.problems import build_prompt
    from qerl.evaluation.evaluate import eval_examples

    settings = load_settings(ROOT / "params" / "compare.yaml")
    examples = eval_examples(settings, limit=n)
    return [build_prompt(tokenizer, e.question, settings.data.system_prompt) for e in examples], examples


class Completions:
    """Prompts left-padded to one length, completions right-padded after them: every completion token sits at the
    same columns, so one forward gives the next-token distributions at all of them."""

    def __init__(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int):
        p = max(map(len, prompt_ids))
        c = max(map(len, completion_ids))
        rows = len(prompt_ids)
        self.ids = torch.full((rows, p + c), pad_id, dtype=torch.long)
        self.attn = torch.zeros(rows, p + c, dtype=torch.long)
        self.mask = torch.zeros(rows, c, dtype=torch.bool)  # which completion positions are real tokens
        for r, (pi, ci) in enumerate(zip(prompt_ids, completion_ids)):
            self.ids[r, p - len(pi):p] = torch.tensor(pi)
            self.ids[r, p:p + len(ci)] = torch.tensor(ci)
            self.attn[r, p - len(pi):p + len(ci)] = 1
            self.mask[r, :len(ci)] = True
        self.prediction_columns = torch.arange(p - 1, p + c - 1)  # logits there predict completion tokens
        self.tokens = int(self.mask.sum())


@torch.no_grad()
def log_probs(model, batch: Completions, micro: int = 16) -> torch.Tensor:
    """log softmax of the next-token logits [rows, completion length, vocab] (fp32), micro-batched."""
    out = []
    for start in range(0, batch.ids.shape[0], micro):
        rows = slice(start, start + micro)
        logits = model(batch.ids[rows], attention_mask=batch.attn[rows], logits_to_keep=batch.prediction_columns)
        out.append(torch.log_softmax(logits.float(), -1))
    return torch.cat(out)


class LayerInputs:
    """The dense model's hidden state entering every decoder layer, kept per micro-batch, so that a model changed
    only from layer L on is run from layer L: the per-layer sensitivity then costs about half the forwards."""

    @torch.no_grad()
    def __init__(self, model, batch: Completions, micro: int = 16):
        if model.config.sliding_window is not None:
            raise ValueError("LayerInputs assumes full attention in every layer (SmolLM2: Llama)")
        self.model, self.batch, self.chunks = model, batch, []
        decoder = model.model
        for start in range(0, batch.ids.shape[0], micro):
            ids, attn = batch.ids[start:start + micro], batch.attn[start:start + micro]
            position_ids, masks = decoder.masks(ids.shape[0], ids.shape[1], attn, device=ids.device)
            cos, sin = decoder.rope_tables(position_ids)[False]
            side = (cos[:, None], sin[:, None], masks[False])
            x, inputs = decoder.embed(ids), []
            for layer in decoder.layers:
                inputs.append(x)
                x = layer(x, *side, None, None)
            self.chunks.append((side, inputs))

    @torch.no_grad()
    def log_probs_from(self, first: int) -> torch.Tensor:
        """`log_probs` of the model as it is now, given that layers before `first` are unchanged."""
        decoder, out = self.model.model, []
        for side, inputs in self.chunks:
            x = inputs[first]
            for layer in decoder.layers[first:]:
                x = layer(x, *side, None, None)
            hidden = decoder.norm(x)[:, self.batch.prediction_columns]
            out.append(torch.log_softmax(self.model.softcap(self.model.lm_head(hidden)).float(), -1))
        return torch.cat(out)


def compare(reference: torch.Tensor, other: torch.Tensor, batch: Completions) -> dict[str, float]:
    """Per-token means over real completion tokens: entropy of `other`, KL(reference || other), top-1 agreement,
    and the log-prob `other` gives the reference's own tokens."""
    m = batch.mask
    p = reference.exp()
    entropy = -(other.exp() * other).sum(-1)
    kl = (p * (reference - other)).sum(-1)
    agree = reference.argmax(-1) == other.argmax(-1)
    target = batch.ids[:, batch.prediction_columns + 1]
    token_lp = other.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    kl_m = kl[m]
    return {"entropy": float(entropy[m].mean()), "kl": float(kl_m.mean()),
            "kl_p90": float(kl_m.quantile(0.9)), "top1_agree": float(agree[m].double().mean()),
            "token_logprob": float(token_lp[m].mean()), "tokens": batch.tokens}


class Swapped:
    """Set some decoder linears' weights to other values for a `with` block, then put the dense ones back."""

    def __init__(self, linears: dict[str, torch.nn.Linear], weights: dict[str, torch.Tensor]):
        self.linears, self.weights, self.saved = linears, weights, {}

    def __enter__(self):
        for n, w in self.weights.items():
            self.saved[n] = self.linears[n].weight.data
            self.linears[n].weight.data = w.to(self.saved[n].dtype)

    def __exit__(self, *exc):
        for n, w in self.saved.items():
            self.linears[n].weight.data = w


def own_samples(model, tokenizer, linears, formats, prompts, examples, pad, args, log) -> dict:
    """The seed study's measurement: each format's entropy along its *own* sampled completions (T = 1, the same seed
    for every format), with KL(dense || format) along them, their length and reward; and its greedy accuracy."""
    from qerl.data.rewards import score
    from qerl.rollout.generate import generate

    out = {}
    dense_weights = {n: m.weight.data for n, m in linears.items()}
    for f in ["dense"] + [f for f in formats if f != "bf16-rounded"]:
        with Swapped(linears, formats.get(f, dense_weights)):
            sampled = generate(model, tokenizer, prompts, args.max_new_tokens, temperature=1.0, seed=args.seed)
            greedy = generate(model, tokenizer, prompts, args.max_new_tokens, temperature=0.0)
            batch = Completions(sampled.prompt_ids, sampled.completion_ids, pad)
            own = log_probs(model, batch)
        row = compare(log_probs(model, batch), own, batch)  # the dense model along the format's own paths
        row.update(completion_tokens=batch.tokens / len(prompts),
                   sampled_reward=sum(score(t, e.gold) for t, e in zip(sampled.texts, examples)) / len(prompts),
                   greedy_accuracy=sum(score(t, e.gold) for t, e in zip(greedy.texts, examples)) / len(prompts),
                   greedy_texts=greedy.texts[:3], sampled_texts=sampled.texts[:3])
        out[f] = row
        log(f"own samples {f}: entropy {row['entropy']:.3f}, KL {row['kl']:.4f}, greedy acc {row['greedy_accuracy']:.3f}")
    return out


# ------------------------------------------------------------------------------------------------ 4. codec


def ct_quantize(w: torch.Tensor, g: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors' NVFP4A16 path, as llm-compressor drives it: min-max observer in the weight's dtype,
    `generate_gparam`, `calculate_qparams`, then the NVFP4 compressor's packing."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    blocks = w.unflatten(-1, (w.shape[1] // 16, 16))
    g = generate_gparam(w.amin(), w.amax()) if g is None else g
    scale, zero_point = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, g)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_global_scale": g, "weight_zero_point": zero_point}
    return dict(NVFP4PackedCompressor.compress(state, scheme))


def codec_check(name: str, w: torch.Tensor) -> dict:
    """qerl vs reference vs compressed-tensors on one weight: shares of element values and block scales that differ,
    and each one's relative reconstruction error against the (fp64) weight."""
    ours = nvfp4.quantize(w)
    ref = nvfp4_reference.quantize(w)
    ours_values = nvfp4.e2m1_decode(nvfp4.unpack_e2m1(ours["weight_packed"]))
    ref_values = nvfp4.e2m1_decode(ref["codes"])
    w64 = w.double()
    row = {"weight": name, "dtype": str(w.dtype).removeprefix("torch."), "shape": list(w.shape),
           "global_scale_qerl": float(ours["weight_global_scale"]), "global_scale_ref": float(ref["global_scale"]),
           "values_differ_vs_ref": float((ours_values != ref_values).double().mean()),
           "scales_differ_vs_ref": float((ours["weight_scale"].view(torch.uint8) != ref["scale"].view(torch.uint8))
                                         .double().mean()),
           "rel_error_qerl": float((nvfp4.dequantize(ours["weight_packed"], ours["weight_scale"],
                                                     ours["weight_global_scale"], torch.float64) - w64).norm() / w64.norm()),
           "rel_error_ref": float((nvfp4_reference.dequantize(ref) - w64).norm() / w64.norm())}
    if importlib.util.find_spec("compressed_tensors") is not None:
        theirs = ct_quantize(w)
        row["bytes_differ_vs_ct"] = {k: float((ours[k].contiguous().view(torch.uint8)
                                               != theirs[k].contiguous().view(torch.uint8)).double().mean())
                                     for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        row["rel_error_ct"] = float((nvfp4.dequantize(theirs["weight_packed"], theirs["weight_scale"],
                                                      theirs["weight_global_scale"], torch.float64) - w64).norm() / w64.norm())
    return row


# ------------------------------------------------------------------------------------------------ driver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "quant_error")
    parser.add_argument("--prompts", type=int, default=64, help="held-out questions")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="as params/compare.yaml's rollouts")
    parser.add_argument("--seed", type=int, default=0, help="the sampled completions' seed")
    parser.add_argument("--sensitivity-prompts", type=int, default=32, help="of the sampled completions")
    parser.add_argument("--own-samples-only", action="store_true",
                        help="only part 2b (each format's own completions), merged into an existing results.json")
    parser.add_argument("--remedies", action="store_true",
                        help="only part 2b for NVFP4 and the remedy arms' bases (flows/arms.py): remedies.json")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: on a shared 2-core box one thread ran a forward 3x faster than two")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from qerl.model.loading import embedded_model_path, load_model
    from qerl.rollout.generate import generate

    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.0f}s] {msg}", flush=True)  # noqa: E731
    model, tokenizer = load_model(embedded_model_path(), dtype=torch.float32)
    model.eval()
    linears = decoder_linears(model)
    if args.remedies:  # each base's entropy and KL along its own samples, with the same prompts and seed as part 2b
        formats = remedy_formats(model)
        prompts, examples = held_out_prompts(tokenizer, args.prompts)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        weights = {f: {"rel_error": sum(weight_stats(linears[n].weight.detach().float(), w)["rel_error"]
                                        for n, w in ws.items()) / len(ws)} for f, ws in formats.items()}
        remedies = {"own_samples": own_samples(model, tokenizer, linears, formats, prompts, examples, pad, args, log),
                    "weights_mean": weights, "setup": {"prompts": len(prompts), "seed": args.seed,
                                                       "max_new_tokens": args.max_new_tokens, "threads": args.threads}}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "remedies.json").write_text(json.dumps(remedies, indent=1))
        log(f"wrote {args.out / 'remedies.json'}")
        return 0
    dense = {n: m.weight.detach().float().clone() for n, m in linears.items()}
    formats = all_formats(model, linears)
    log(f"formats: {', '.join(formats)} over {len(linears)} linears")
    probe_weights = probes(dense, formats, args.seed)
    results: dict = {"formats": list(formats), "probes": list(probe_weights), "linears": len(linears)}
    if args.own_samples_only:  # e.g. after a run made before part 2b existed: the rest is unchanged by it
        results = json.loads((args.out / "results.json").read_text())
        prompts, examples = held_out_prompts(tokenizer, args.prompts)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        results["own_samples"] = own_samples(model, tokenizer, linears, formats, prompts, examples, pad, args, log)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        return 0

    # 1. weights
    results["weights"] = {f: {n: weight_stats(dense[n], wq[n]) for n in dense}
                          for f, wq in {**formats, **probe_weights}.items()}
    log("weight statistics done")

    # 4. codec (cheap, before the long part)
    picks = [n for n in dense if n.endswith(("layers.0.self_attn.q_proj", "layers.15.mlp.down_proj",
                                             "layers.29.mlp.gate_proj", "layers.3.self_attn.v_proj"))]
    g = torch.Generator().manual_seed(args.seed)
    samples = {"random N(0, 0.02)": torch.randn(576, 1536, generator=g) * 0.02, **{n: dense[n] for n in picks}}
    results["codec"] = [codec_check(n, w.to(dt)) for n, w in samples.items() for dt in (torch.float32, torch.bfloat16)]
    log("codec check done")

    # 2. policy: the dense model's completions, then every format teacher-forced along them
    prompts, examples = held_out_prompts(tokenizer, args.prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runs = {}
    for kind, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        rollout = generate(model, tokenizer, prompts, args.max_new_tokens, temperature=temperature, seed=args.seed)
        runs[kind] = (rollout, Completions(rollout.prompt_ids, rollout.completion_ids, pad))
        log(f"{kind} completions: {runs[kind][1].tokens} tokens")
    results["greedy_texts"] = runs["greedy"][0].texts[:8]
    references = {kind: log_probs(model, batch) for kind, (_, batch) in runs.items()}
    results["policy"] = {kind: {"dense": compare(references[kind], references[kind], batch)}
                         for kind, (_, batch) in runs.items()}
    for f, weights in {**formats, **probe_weights}.items():
        with Swapped(linears, weights):
            for kind, (_, batch) in runs.items():
                results["policy"][kind][f] = compare(references[kind], log_probs(model, batch), batch)
        log(f"policy {f}: " + ", ".join(f"{k} KL {results['policy'][k][f]['kl']:.4f} H {results['policy'][k][f]['entropy']:.3f}"
                                        for k in runs))

    # 3. sensitivity: NVFP4 on one layer or one projection type at a time, along the first --sensitivity-prompts
    # sampled completions (the dense model's inputs to each layer cached: a one-layer change runs from that layer)
    rollout = runs["sampled"][0]
    rows = list(range(min(args.sensitivity_prompts, len(prompts))))
    batch = Completions([rollout.prompt_ids[r] for r in rows], [rollout.completion_ids[r] for r in rows], pad)
    cached = LayerInputs(model, batch)
    reference = cached.log_probs_from(0)
    sensitivity: dict = {"prompts": len(rows), "tokens": batch.tokens, "layer": {}, "projection": {},
                         "cache_check_max_abs": float((reference - log_probs(model, batch)).abs().max()),
                         "dense": compare(reference, reference, batch)}
    for projection in PROJECTIONS:
        with Swapped(linears, {n: w for n, w in formats["nvfp4"].items() if layer_and_projection(n)[1] == projection}):
            sensitivity["projection"][projection] = compare(reference, cached.log_probs_from(0), batch)
    log("sensitivity by projection done")
    for layer in sorted({layer_and_projection(n)[0] for n in dense}):
        with Swapped(linears, {n: w for n, w in formats["nvfp4"].items() if layer_and_projection(n)[0] == layer}):
            sensitivity["layer"][str(layer)] = compare(reference, cached.log_probs_from(layer), batch)
    log("sensitivity by layer done")
    results["sensitivity_nvfp4"] = sensitivity
    results["own_samples"] = own_samples(model, tokenizer, linears, formats, prompts, examples, pad, args, log)
    results["setup"] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                        "sensitivity_prompts": len(rows),
                        "threads": args.threads, "task": "params/compare.yaml (2-digit addition, test split)",
                        "dense_dtype": "float32", "seconds": time.perf_counter() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
