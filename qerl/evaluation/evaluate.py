"""Accuracy of a policy on a split: greedy, or k samples with mean accuracy and pass@k."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from qerl.config import Settings
from qerl.model.served import own_model_settings, vllm_options
from qerl.rollout.backends import RolloutBackend, Sampling
from qerl.rollout.factory import engine_options, make_backend
from qerl.rollout.multi_turn import ToolUse, tool_use_of
from qerl.run import atomic

if TYPE_CHECKING:
    from qerl.quant.checkpoint import QuantizeReport

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    metrics: dict[str, float]
    records: list[dict[str, Any]] = field(default_factory=list)
    grader: dict[str, str] = field(default_factory=dict)  # what graded (qerl.grading.grader_info()): name, versions

    def save(self, out_dir: str | Path) -> Path:
        """Writes metrics.json (the metrics and the grader that produced them) and samples.jsonl (one row per example
        and sample: the completion, its extracted answer beside the gold's, the score) atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic.write_text(out / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in self.records))
        atomic.write_json(out / "metrics.json", {**self.metrics, **self.grader})
        return out


@torch.no_grad()
def perplexity(folder: str | Path, text: str, device: torch.device | str | None = None,
               max_tokens: int = 2048) -> float:
    """exp(mean next-token NLL) of `text` (first `max_tokens` tokens) under the model in `folder`."""
    from qerl.model.loading import load_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = load_model(folder, device=device)
    if tokenizer is None:
        raise ValueError(f"{folder}: no tokenizer files, cannot compute perplexity")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens].to(device)
    if ids.shape[1] < 2:
        raise ValueError("eval_text must have at least 2 tokens")
    logits = model(ids)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    return math.exp(nll.item())


def add_perplexity(report: QuantizeReport, text: str, device: torch.device | str | None = None) -> QuantizeReport:
    """Perplexity of `text` before and after quantization, into `report` (its summary shows it) and the log.

    Here rather than in the checkpoint writer, which then needs no model loader (the loader reads its formats).
    """
    report.perplexity_before = perplexity(report.src, text, device)
    report.perplexity_after = perplexity(report.dst, text, device)
    log.info("perplexity %.3f -> %.3f", report.perplexity_before, report.perplexity_after)
    return report


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(
    model,
    tokenizer,
    examples: Sequence,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    num_samples: int = 1,
    batch_size: int = 16,
    seed: int = 0,
    system_prompt: str | None = None,
    reward_fn: Callable[[str, str], float] | None = None,
    progress: bool = True,
    backend: RolloutBackend | None = None,
    tools: ToolUse | None = None,
) -> EvalResult:
    """Generate `num_samples` completions per example and score them against the gold answers.

    `backend` samples (default: `make_backend(model, tokenizer)`, the engine on CUDA, the reference on the CPU).
    `tools`: multi-turn completions calling them (`qerl.rollout.multi_turn`; graded on the whole completion, tool
    turns included, as the training rewards see it); the metrics then count the calls (tool_calls per sample,
    tool_errors, tool_timeouts)."""
    from qerl import grading
    from qerl.data import problems as data

    timeouts = grading.stats()["timeouts"]
    system_prompt = system_prompt if system_prompt is not None else data.SYSTEM_PROMPT
    jobs = [(ex, s) for ex in examples for s in range(num_samples)]
    records: list[dict[str, Any]] = []
    start, tokens = time.perf_counter(), 0
    backend = backend or make_backend(model, tokenizer)
    bar = tqdm(total=len(jobs), desc="eval", unit="sample", disable=not progress)
    calls: dict[str, float] = {}
    functions = list(tools.tools.values()) if tools is not None else ()
    for b in range(0, len(jobs), batch_size):
        chunk = jobs[b : b + batch_size]
        prompts = [data.build_prompt(tokenizer, ex.question, system_prompt, tools=functions) for ex, _ in chunk]
        sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + b)
        if tools is None:
            out = backend.generate(prompts, sampling)
        else:
            out, counts = backend.generate_with_tools(prompts, sampling, tools, rows=[ex.columns for ex, _ in chunk])
            for k in ("tool_calls", "tool_errors", "tool_timeouts"):
                calls[k] = calls.get(k, 0) + counts[k]
        for (ex, sample), prompt, text, ids, reason in zip(chunk, prompts, out.texts, out.completion_ids,
                                                          out.stop_reasons):
            tokens += len(ids)
            graded = grading.grade(text, ex.gold)
            records.append({
                "id": ex.id, "sample": sample, "prompt": prompt, "completion": text,
                "extracted": graded.answer, "gold_answer": graded.gold, "gold": ex.gold,
                "score": float(reward_fn(text, ex.gold)) if reward_fn else graded.score,
                "graded_by": graded.decided_by if reward_fn is None else "reward_fn", "stop_reason": reason,
            })
        bar.update(len(chunk))
        bar.set_postfix(acc=f"{sum(r['score'] for r in records) / len(records):.3f}")
    bar.close()
    metrics = _summarize(records, num_samples, tokens, time.perf_counter() - start)
    if calls:
        metrics.update(calls, tool_calls=calls["tool_calls"] / max(len(records), 1))  # per sample
    metrics["grader_timeouts"] = grading.stats()["timeouts"] - timeouts
    grader = grading.grader_info() if reward_fn is None else {"grader": getattr(reward_fn, "__qualname__", "custom")}
    return EvalResult(metrics, records, grader)


def _summarize(records: list[dict], k: int, tokens: int, seconds: float) -> dict[str, float]:
    by_example: dict[str, list[float]] = {}
    for r in records:
        by_example.setdefault(r["id"], []).append(r["score"])
    n = len(by_example)
    metrics = {
        "accuracy": sum(r["score"] for r in records) / max(len(records), 1),
        "num_examples": n,
        "num_samples": k,
        "truncation_rate": sum(r["stop_reason"] == "length" for r in records) / max(len(records), 1),
        "mean_completion_tokens": tokens / max(len(records), 1),
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "seconds": seconds,
    }
    if k > 1:
        metrics[f"pass@{k}"] = sum(pass_at_k(k, sum(s >= 1.0 for s in v), k) for v in by_example.values()) / max(n, 1)
    return metrics


def eval_examples(settings: Settings, limit: int | None = None) -> list:
    """The evaluation split named by `settings.eval` (arithmetic knobs shared with `settings.data`)."""
    from qerl.data import problems as data

    return data.examples_for(settings.eval, knobs=settings.data, n=limit or settings.eval.n,
                             key="--limit" if limit else "eval.n")


def run_eval(settings: Settings, adapter: str | None = None, out_dir: str | Path | None = None,
             limit: int | None = None, model=None, tokenizer=None, progress: bool = True,
             backend: RolloutBackend | None = None) -> EvalResult:
    """Load the policy (base + optional adapter) and evaluate it as `settings.eval` says; save if `out_dir`.

    Samples with `backend` (e.g. the trainer's), else with `settings.rollout.backend` built for the model."""
    from qerl.data.problems import SYSTEM_PROMPT
    from qerl.data.prompt_length import fit_prompts, model_context
    from qerl.model.runtime import load_policy, load_tokenizer_and_context, pin_cpu_threads

    pin_cpu_threads(settings.model)
    e = settings.eval
    tools = tool_use_of(settings.rollout)  # rollout.tools: multi-turn completions, as training samples them
    examples = eval_examples(settings, limit)  # before the model: bad data fails in a second, not after a load
    if model is None:
        tokenizer, context = load_tokenizer_and_context(settings.model, settings.quant)
    else:
        context = model_context(model)
    system_prompt = settings.data.system_prompt if settings.data.system_prompt is not None else SYSTEM_PROMPT
    examples = fit_prompts(examples, tokenizer, system_prompt, context, e.max_new_tokens, source=e.path or e.name,
                           setting="eval.max_new_tokens", policy=settings.data.overlong_prompts)
    if model is None:
        model, tokenizer = load_policy(own_model_settings(settings), adapter=adapter)
    backend = backend or make_backend(
        model, tokenizer, settings.rollout.backend, **engine_options(settings.rollout),
        vllm=lambda: vllm_options(settings, model_context(model)))
    result = evaluate(model, tokenizer, examples, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                      top_p=e.top_p, num_samples=e.num_samples, batch_size=e.batch_size, seed=e.seed,
                      system_prompt=settings.data.system_prompt, progress=progress, backend=backend, tools=tools)
    if out_dir is not None:
        result.save(out_dir)
    log.info("eval: %s (graded by %s)", ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()),
             ", ".join(f"{k} {v}" for k, v in result.grader.items()))
    return result
