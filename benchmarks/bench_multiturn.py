"""Multi-turn rollouts on the engine (issue #64) against single-turn rollouts of the same total length: tokens/s, and
how long the GPU had nothing to decode while tools ran.

    PYTHONPATH=. python3 benchmarks/bench_multiturn.py --model 7b --scheme nvfp4 --batch 64 --turns 3 \
        --turn-tokens 256 --answer-tokens 48 --latency 0.5 --out DIR            # one H200
    PYTHONPATH=. python3 benchmarks/bench_multiturn.py --model tiny --device cpu --batch 4 --turn-tokens 16 \
        --answer-tokens 6 --latency 0.05                                         # a CPU dry run (seconds)

Random weights of a published shape (`bench_rollout.build_model`) have no tool-calling habits, so a synthetic policy
stands in: a logits processor makes row r end its turns at lengths drawn per row (uniform in [turn/2, 3 turn/2],
seeded, so the rows' calls are spread out as a real step's are) with the tool-call token, and end its last turn with
EOS. The tool sleeps `--latency` seconds (a fixed simulated latency) and answers with `--answer-tokens` tokens (the
tool turn's glue included). Everything else is the product's path: `qerl.rollout.multi_turn.generate_with_tools` on
the model's `RolloutEngine` (rows at their own slots, calls on threads, the answer prefilled into the row's cache).

The single-turn arm samples the same completion lengths (generated + tool tokens) with `RolloutEngine.generate`, the
same processor (EOS at each row's total length), so both arms decode the same shapes. Reported per arm: tokens/s
(completion tokens, tool turns included, over the call's wall time, prefill included), generated tokens/s, and for the
multi-turn arm the wall time the loop waited with no row able to decode (`idle_seconds`: every unfinished row waiting
for a tool; the GPU idles then) as a share of the call, and the tools' summed wall time (what ran off the critical
path). Targets (issue #64): multi-turn tokens/s >= 0.9x single-turn; no wait while a row could decode (the loop only
waits when none can: idle_seconds counts exactly those waits). Results: DIR/multiturn.jsonl and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qerl.rollout.engine import RolloutEngine  # noqa: E402
from qerl.rollout.multi_turn import ToolUse, generate_with_tools  # noqa: E402
from qerl.rollout.tool_calls import ToolCallFormat  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import build_model  # noqa: E402

CALL, EOS, ANSWER = 7, 3, 11  # the synthetic policy's tool-call token, EOS, and the token a tool turn is made of


class SyntheticTokenizer:
    """Token ids as text for the random model: CALL reads as the closing tag, every other id as one letter."""

    eos_token_id = EOS

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self):
        return self.vocab

    def convert_ids_to_tokens(self, ids):
        return ["</tool_call>" if i == CALL else "a" for i in ids]

    def decode(self, ids, skip_special_tokens=True):
        return "".join("</tool_call>" if i == CALL else "a" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ANSWER] * len(text)


class FixedTurn:
    """A tool turn of exactly `n` tokens, whatever the answer says (a `ToolTurn` to `generate_with_tools`)."""

    def __init__(self, n: int):
        self.n = n

    def tokens(self, tokenizer, answer):
        return [ANSWER] * self.n


class AnyCall(ToolCallFormat):
    def parse(self, text):
        return "wait", {}


def turn_lengths(batch: int, turns: int, turn: int, seed: int) -> list[list[int]]:
    """Each row's assistant-turn lengths (turns + 1 of them: the last ends with EOS)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(max(1, turn // 2), turn + turn // 2 + 1, (batch, turns + 1), generator=g).tolist()


def script(lengths: list[list[int]], answer: int, multi_turn: bool, vocab: int, device) -> tuple[object, list[int]]:
    """The synthetic policy as a logits processor (no host sync: a table on the device), and each row's completion
    length. Multi-turn: CALL ends each turn but the last, a tool turn of `answer` tokens follows; single-turn: the
    same positions free, EOS at the same total length."""
    totals = [sum(ls) + answer * (len(ls) - 1) for ls in lengths]
    table = torch.full((len(lengths) + 1, max(totals) + 1), -1, dtype=torch.long)
    for r, ls in enumerate(lengths):
        at = 0
        for k, n in enumerate(ls):
            at += n
            last = k == len(ls) - 1
            if multi_turn or last:
                table[r, at - 1] = EOS if last else CALL
            at += 0 if last else answer
    table = table.to(device)
    banned = torch.tensor([CALL, EOS], device=device)

    def process(logits, rows, positions):
        forced = table[rows.clamp(max=len(lengths)), positions.clamp(max=table.shape[1] - 1)]
        logits.index_fill_(1, banned, float("-inf"))  # CALL and EOS only where the script puts them
        pick = torch.full_like(logits, float("-inf")).scatter_(1, forced.clamp(min=0)[:, None], 0.0)
        logits.copy_(torch.where((forced >= 0)[:, None], pick, logits))
    return process, totals


class Phases:
    """Host wall time inside the outside-lockstep step's parts (`--phases`): the verify forward's launch and gather,
    the draw (its `.tolist()` waits for the GPU: the step's one sync), the rows' host bookkeeping, the tool turns'
    prefills. What is left of the call's time is the rest of the loop (the call's own Python, the tool threads)."""

    PARTS = {"forward launch": ("qerl.rollout.speculation", "SpeculativeRows", "_logits"),
             "draw + sync": ("qerl.rollout.speculation", "SpeculativeRows", "_draw"),
             "row bookkeeping": ("qerl.rollout.rows", "Row", "advance"),
             "tool-turn prefill": ("qerl.rollout.engine", "RolloutEngine", "extend_rows"),
             "outside step": ("qerl.rollout.speculation", "SpeculativeRows", "step")}

    def __init__(self, sync: bool, probe: bool = False):
        import importlib

        self.seconds = {k: 0.0 for k in self.PARTS}
        self.calls = {k: 0 for k in self.PARTS}
        self.each: dict[str, list[float]] = {k: [] for k in self.PARTS}
        self.probed = not probe
        self._undo = []
        for name, (module, cls, method) in self.PARTS.items():
            owner = getattr(importlib.import_module(module), cls)
            real = getattr(owner, method)
            self._undo.append((owner, method, real))
            setattr(owner, method, self._timed(name, real, sync and name == "tool-turn prefill"))

    def _timed(self, name, real, sync):
        def timed(*a, **k):
            if sync and self.calls[name] == 50 and not self.probed:  # one warm tool-turn prefill, profiled
                self.probed = True
                self._profiled(real, *a, **k)
            start = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                if sync:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                self.each[name].append(time.perf_counter() - start)
        return timed

    def _profiled(self, real, *a, **k):
        try:
            self._probe(real, *a, **k)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the benchmark goes on without it
            print(f"  (the extend probe failed: {type(e).__name__}: {e})", flush=True)

    def _probe(self, real, *a, **k):
        """One warm tool-turn prefill under the profiler, its host and GPU time, and the model's plain forward of
        1-64 rows of as many tokens (what one forward for several rows' tool turns would cost)."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            real(*a, **k)
            torch.cuda.synchronize()
        engine, tokens = a[0], a[2]
        for _ in range(3):  # the same tokens at the same slots: idempotent, so the rollout is unchanged
            t0 = time.perf_counter()
            real(*a, **k)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            print(f"  extend_row of {len(tokens)} tokens: host {1e3 * (t1 - t0):.1f} ms, with the GPU "
                  f"{1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
        for rows in (1, 4, 16, 64):  # the model's plain forward (no cache) of rows x tokens: how a batch would cost
            ids = torch.full((rows, len(tokens)), ANSWER, device="cuda")
            with torch.no_grad():
                engine.model(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.model(ids, logits_to_keep=1)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
            print(f"  plain forward {rows} x {len(tokens)}: host {1e3 * (t1 - t0):.1f} ms, with the GPU "
                  f"{1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60), flush=True)
        print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)

    def restore(self):
        for owner, method, real in self._undo:
            setattr(owner, method, real)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    model = build_model(args.model, args.scheme, device=args.device)
    vocab = model.config.vocab_size
    tokenizer = SyntheticTokenizer(vocab)
    engine = RolloutEngine(model)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(100, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    lengths = turn_lengths(args.batch, args.turns, args.turn_tokens, args.seed)

    def wait() -> str:
        """A tool with a fixed simulated latency."""
        time.sleep(args.latency)
        return "done"

    use = ToolUse({"wait": wait}, timeout_s=args.latency * 10 + 5, workers=args.batch, format=AnyCall(),
                  turn=FixedTurn(args.answer_tokens))
    rows = []
    for arm in ("single-turn", "multi-turn"):
        process, totals = script(lengths, args.answer_tokens, arm == "multi-turn", vocab, device)
        kw = dict(temperature=1.0, eos_token_ids=[EOS], row_seeds=list(range(args.batch)), logits_processor=process)
        for timed in (False, True):  # the first call captures the graphs (a warm trainer has them)
            if device.type == "cuda":
                torch.cuda.synchronize()
            phases = Phases(device.type == "cuda", args.probe) if args.phases and timed and arm == "multi-turn" else None
            start = time.perf_counter()
            if arm == "multi-turn":
                out, stats = generate_with_tools(engine, tokenizer, prompts, max(totals), use, **kw)
            else:
                out, stats = engine.generate(tokenizer, prompts, max(totals), **kw), {}
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if phases is not None:
                phases.restore()
                for name in Phases.PARTS:
                    each = sorted(phases.each[name]) or [0.0]
                    print(f"  {name}: {phases.seconds[name]:.2f} s over {phases.calls[name]} calls "
                          f"({1e3 * phases.seconds[name] / max(1, phases.calls[name]):.2f} ms each; first "
                          f"{1e3 * (phases.each[name] or [0.0])[0]:.1f}, median {1e3 * each[len(each) // 2]:.2f}, "
                          f"max {1e3 * each[-1]:.1f} ms)", flush=True)
                print(f"  the call: {seconds:.2f} s; engine stats {engine.stats}", flush=True)
        tokens = sum(map(len, out.completion_ids))
        generated = sum(int(m.sum()) for m in out.masks())
        assert [len(c) for c in out.completion_ids] == totals, "the synthetic policy's lengths were not kept"
        rows.append({"arm": arm, "model": args.model, "scheme": args.scheme, "batch": args.batch,
                     "turns": args.turns, "turn_tokens": args.turn_tokens, "answer_tokens": args.answer_tokens,
                     "latency_s": args.latency, "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "generated_per_s": generated / seconds, "tool_calls": stats.get("tool_calls", 0),
                     "idle_share": stats.get("idle_seconds", 0.0) / seconds,
                     "tool_seconds": stats.get("tool_seconds", 0.0),
                     "tool_turn_prefills": stats.get("tool_turn_prefills", 0), "device": torch.cuda.get_device_name()
                     if device.type == "cuda" else "cpu"})
    rows[1]["vs_single_turn"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="7b")
    p.add_argument("--scheme", default="nvfp4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--turns", type=int, default=3, help="tool calls per row")
    p.add_argument("--turn-tokens", type=int, default=256, help="mean generated tokens per assistant turn")
    p.add_argument("--answer-tokens", type=int, default=48, help="tokens of a tool turn (answer and glue)")
    p.add_argument("--latency", type=float, default=0.5, help="the tool's fixed latency, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phases", action="store_true", help="time the outside-lockstep step's parts (host wall time)")
    p.add_argument("--probe", action="store_true", help="with --phases on CUDA: profile one tool-turn prefill and "
                   "time the plain forward of 1-64 rows of as many tokens")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = run(args)
    print("| arm | tokens/s | generated/s | tool calls | tool-turn prefills | idle share | tools' seconds | "
          "vs single-turn |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['tokens_per_s']:.0f} | {r['generated_per_s']:.0f} | {r['tool_calls']} | "
              f"{r['tool_turn_prefills']} | "
              f"{r['idle_share']:.3f} | {r['tool_seconds']:.1f} | {r.get('vs_single_turn', 1.0):.3f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "multiturn.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
