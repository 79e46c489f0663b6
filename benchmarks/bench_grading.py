"""The grader (qerl.grading) against math-verify alone and against qerl's grader before #29: accuracy on the case
tables, the cost of scoring a GRPO step's completions, and time on hostile completions. CPU only.

    python benchmarks/bench_grading.py                                  # all three tables
    python benchmarks/bench_grading.py --old-ref 481760a                 # qerl-old = qerl/rewards.py at that commit
    python benchmarks/bench_grading.py --samples runs/default/eval/samples.jsonl   # step cost on real completions

Accuracy: a grader is right on a case when its score equals the case's expected value (tests/grading_cases/).
math-verify is run as TRL and open-r1 run it, `verify(parse(gold), parse(completion))` with its defaults, in this
process (its signal timeouts need the main thread). Step cost: the trainer grades each completion twice (the reward
mix, then the accuracy metric), so that is what is timed, after the worker has started (the trainer starts it while
the model loads).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl import grading  # noqa: E402
from qerl.data.problems import arithmetic_task  # noqa: E402
from tests.grading_cases import completion_cases, math_verify_suite  # noqa: E402
from tests.test_grading import HOSTILE  # noqa: E402


def old_grader(ref: str):
    """qerl.data.rewards.score as it was at git `ref` (a self-contained module then)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:qerl/rewards.py"], capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_rewards.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


def math_verify_score(completion: str, gold: str) -> float:
    from math_verify import parse, verify

    try:
        return float(verify(parse(gold), parse(completion)))
    except Exception:  # noqa: BLE001 - its own timeouts raise; a grader's crash is a wrong answer
        return 0.0


def accuracy_table(old_ref: str) -> None:
    old = old_grader(old_ref)
    grading.start_worker(wait=True)
    graders = {f"qerl ({grading.CPU_BUDGET_S} s CPU budget)": lambda c, g: grading.grade(c, g).score,
               "math-verify 0.9.0": math_verify_score, f"qerl (old, {old_ref})": old}
    print("| set | n | " + " | ".join(graders) + " |\n|---|---|" + "---|" * len(graders))
    for name, cases in (("math-verify's suite (judged)", math_verify_suite()),
                        ("completion-style cases", completion_cases())):
        right = {g: 0 for g in graders}
        times = {g: [] for g in graders}
        for case in cases:
            for g, fn in graders.items():
                start = time.perf_counter()
                right[g] += int(fn(case.completion, case.gold) == case.expected)
                times[g].append(time.perf_counter() - start)
        cells = [f"{right[g]} ({100 * right[g] / len(cases):.0f}%)" for g in graders]
        print(f"| {name} | {len(cases)} | " + " | ".join(cells) + " |")
        print("| time per case | | " + " | ".join(
            f"median {1e3 * statistics.median(t):.2f} ms, max {1e3 * max(t):.0f} ms" for t in times.values()) + " |")
    print(f"grader timeouts over both tables: {grading.stats()['timeouts']}")


def typical_step(seed: int = 0, prompts: int = 8, group: int = 8) -> list[tuple[str, str]]:
    """64 completions in the shapes SmolLM2-135M gives on the arithmetic task (right and wrong values, bare results,
    equations, sentences, boxes), drawn with `seed`."""
    rng = random.Random(seed)
    shapes = ["{v}", "{q} = {v}", "The answer is {v}.", "{q} = {v}. So the answer is {v}.", "\\boxed{{{v}}}",
              "To find {q}, we compute {q} = {v}.", "{q}\n\n{q} = {v}", "The result is {v} apples.",
              "Let's see: {q}. The answer is $\\boxed{{{v}}}$", "What is {q}?"]
    out = []
    for ex in arithmetic_task("train", prompts, seed=seed, digits=1):
        q = ex.question.removeprefix("What is ").rstrip("?")
        for _ in range(group):
            value = int(ex.gold) + rng.choice([0, 0, 0, 1, -1, 10])
            out.append((rng.choice(shapes).format(q=q, v=value), ex.gold))
    return out


def step_cost(pairs: list[tuple[str, str]], repeats: int = 5) -> None:
    """As `Trainer.score` grades a step: the accuracy over the worker pool (grade_all), then the reward mix."""
    from qerl.data.rewards import combined_reward

    reward_fn = combined_reward({"accuracy": 1.0})
    grading.start_worker(wait=True)
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        grading.grade_all(pairs)
        for completion, gold in pairs:
            reward_fn(completion, gold)
        times.append(time.perf_counter() - start)
        if r == 0:
            before = grading.stats()
    print(f"{len(pairs)} completions graded twice (accuracy over {grading._mathverify.size} math-verify worker(s), "
          f"then the reward): first pass {1e3 * times[0]:.1f} ms, later passes median "
          f"{1e3 * statistics.median(times[1:]):.1f} ms (cached math-verify verdicts)")
    fresh = grading.stats()
    print(f"  decided by qerl's own equality: {fresh['own']}, sent to math-verify: {fresh['math_verify']}, "
          f"timeouts: {fresh['timeouts']} (counts over all passes; after the first: "
          f"{fresh['math_verify'] - before['math_verify']} math-verify requests)")


def hostile_times() -> None:
    grading.start_worker(wait=True)
    print("| hostile completion | worst of 4 golds | decided by |\n|---|---|---|")
    for name, text in HOSTILE.items():
        worst, how = 0.0, set()
        for gold in ("72", "\\frac{14}{3}", "x^2+1", "x<1"):
            start = time.perf_counter()
            got = grading.grade(text, gold)
            worst = max(worst, time.perf_counter() - start)
            how.add(got.decided_by)
        print(f"| {name} | {1e3 * worst:.0f} ms | {', '.join(sorted(how))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-ref", default="481760a", help="git commit of qerl's grader before #29")
    parser.add_argument("--samples", help="an eval samples.jsonl: time the step on its completions and golds")
    parser.add_argument("--math500", type=int, default=0, metavar="N",
                        help="time the step on N MATH-500 worked solutions (data/math500), half against their own "
                             "gold, half against the next problem's: a 7B policy's LaTeX completions")
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    if not args.skip_accuracy:
        accuracy_table(args.old_ref)
    pairs = typical_step()
    if args.samples:
        rows = [json.loads(line) for line in Path(args.samples).read_text().splitlines()]
        pairs = [(r["completion"], r["gold"]) for r in rows][:64]
    if args.math500:
        from qerl.data.problems import load_jsonl

        path = ROOT / "data" / "math500" / "test.jsonl"
        solutions = [json.loads(line)["answer"] for line in path.read_text().splitlines()[:args.math500 + 1]]
        golds = [ex.gold for ex in load_jsonl(path)[:args.math500 + 1]]
        pairs = [(solutions[i], golds[i + (i % 2)]) for i in range(args.math500)]
    step_cost(pairs)
    hostile_times()


if __name__ == "__main__":
    main()
