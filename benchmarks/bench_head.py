"""The update's LM head on one micro-batch: log-probs, entropies and the hidden states' gradient, PyTorch against
`qerl.kernels.vocab_softmax`, and Liger-kernel's log-prob kernel beside them.

    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_head.py --model 7b [--tokens 4096] [--out DIR]

Arms, each timed as forward + backward of `qerl.rl.grpo.head_log_probs` (a frozen head: the trainer's case) on
`--tokens` completion tokens, median of 10 after 3 warm-ups, CUDA events:
- `pytorch`: the path the CPU runs (`QERL_VOCAB_KERNEL=0`), 128 tokens per chunk, as the update ran before the kernel;
- `kernel-cN`: one `vocab_softmax` kernel per chunk of N tokens (N = `chunk_rows`'s choice and its neighbours);
- `logp-only` pairs (no entropy, no gradient, under no_grad): ours against Liger's `fused_selective_log_softmax`,
  both on the same chunk's GEMM output.
Every kernel arm is checked against the PyTorch arm first. What bounds it: the two GEMMs per chunk (logits, and the
softmax times W) at the measured bf16 rate, plus three passes over the bf16 logits at the copy bandwidth.
Rows: DIR/head.jsonl; table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qerl.kernels import vocab_softmax  # noqa: E402
from qerl.execution import training_ops  # noqa: E402
from qerl.rl.grpo import head_log_probs  # noqa: E402

SHAPES = {"7b": (3584, 152064), "32b": (5120, 152064), "llama8b": (4096, 128256), "smollm2": (576, 49152)}


def timed_ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096, help="completion tokens of one micro-batch (4 × 1,024)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="outputs/bench_head")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_head.py needs a CUDA device (the head's kernel runs on CUDA only)")
    fused = training_ops.TrainingOps("auto")  # the fused training kernels, as the trainer's plan has them on CUDA
    plain = training_ops.TrainingOps("auto", vocab_kernel=False)  # QERL_VOCAB_KERNEL=0: the head in PyTorch
    hidden_size, vocab = SHAPES[args.model]
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.tokens, hidden_size, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * hidden_size ** -0.5).bfloat16()
    ids = torch.randint(0, vocab, (args.tokens,), device="cuda", generator=g)
    upstream = torch.randn(args.tokens, device="cuda", generator=g)
    T = args.temperature

    def update(chunk, ops=fused):
        logp, entropy = head_log_probs(hidden[None], weight, ids[None], T, want_entropy=True, chunk_size=chunk,
                                       ops=ops)
        (grad,) = torch.autograd.grad((logp[0] * upstream).sum(), hidden)
        return logp, entropy, grad

    rows = []
    ref = update(128, plain)
    rows.append({"arm": "pytorch", "chunk": 128, "ms": timed_ms(lambda: update(128, plain))})
    best = vocab_softmax.chunk_rows(vocab, 2)
    for chunk in sorted({128, best // 2, best, best * 2}):
        out = update(chunk)
        err = [float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref)]
        rows.append({"arm": f"kernel-c{chunk}", "chunk": chunk, "ms": timed_ms(lambda: update(chunk)),
                     "max_err_logp_entropy_grad": err, "chosen": chunk == best})

    # Log-probs alone, no graph: the part Liger's kernel also does, on the same chunk's logits.
    with torch.no_grad():
        chunks = list(zip(hidden.split(best), ids.split(best)))

        def ours():
            return torch.cat([vocab_softmax.row_stats(torch.nn.functional.linear(h, weight), i, T, False, False)[0]
                              for h, i in chunks])
        rows.append({"arm": "logp-only: qerl kernel", "chunk": best, "ms": timed_ms(ours)})
        try:
            from liger_kernel.ops.grpo_loss import fused_selective_log_softmax
        except ImportError as e:
            rows.append({"arm": "logp-only: liger", "skipped": repr(e)})
        else:
            def liger():  # [B, L + 1, V] logits, row l scored at input_ids[-L + l]: one padding row, one id
                out = []
                for h, i in chunks:
                    logits = torch.nn.functional.linear(torch.cat([h, h[-1:]]), weight)[None]
                    out.append(fused_selective_log_softmax(logits, torch.cat([i[:1], i])[None], T)[0])
                return torch.cat(out)
            err = float((liger() - ours()).abs().max())
            rows.append({"arm": "logp-only: liger", "chunk": best, "ms": timed_ms(liger), "max_err_vs_ours": err})

    flops = 2 * 2 * args.tokens * vocab * hidden_size  # logits, and softmax @ W
    print(f"{torch.cuda.get_device_name()}  {args.model}: {args.tokens} tokens × vocab {vocab} × hidden {hidden_size}; "
          f"the two GEMMs are {flops / 1e12:.2f} TFLOP, the bf16 logits {args.tokens * vocab * 2 / 1e9:.2f} GB")
    print("| arm | chunk | ms | vs pytorch | max |err| (logp, entropy, grad) |\n|---|---|---|---|---|")
    base = rows[0]["ms"]
    for r in rows:
        if "ms" in r:
            err = r.get("max_err_logp_entropy_grad", r.get("max_err_vs_ours", ""))
            print(f"| {r['arm']} | {r['chunk']} | {r['ms']:.2f} | {base / r['ms']:.2f}× | {err} |")
        else:
            print(f"| {r['arm']} | skipped: {r['skipped']} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "head.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps({"model": args.model, "tokens": args.tokens, "device": torch.cuda.get_device_name(),
                                **r}) + "\n")


if __name__ == "__main__":
    main()
