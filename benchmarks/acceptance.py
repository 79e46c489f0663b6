"""Draft acceptance of speculative rollouts on real text: the embedded model (SmolLM2-135M-Instruct, NVFP4 + LoRA)
trained by `qerl train` with `rollout.speculative: on`, over several epochs of the same prompts, per task and arm.

Each run is a plain `qerl train` subprocess (what a user types; printed before it starts). Its `metrics.jsonl` logs
`speculative/acceptance`, `speculative/tokens_per_step` and `speculative/token_share` per step. Arms:

* whole: `rollout.speculative_rows` = the whole batch, so every row speculates from its second token on and the
  acceptance covers the whole completion;
* tail: `rollout.speculative_rows: 8` (the default), speculation only once at most 8 rows are live.

Prompts repeat: by default `data.n` = `rollout.prompts_per_step`, so every step is one epoch over the prompts (epoch
1 has no history to draft from; epoch e drafts from epochs 1..e-1, the newest 16 completions of each prompt).

Replay, to split what the sources give. The run saves a checkpoint every step (`train.save_every: 1`); the script
copies each one's `DraftHistory` (the trainer keeps it in the checkpoint) while the run goes on. Step s's
completions are the newest `group_size` of each of its prompts there, and the history the step drafted from is step
s-1's. Replaying the engine's draft/verify loop on those completions (qerl.rollout.drafts.DraftSession, proposing
exactly as the engine does: same draft lengths, same lock-step order of proposes and extends) reproduces the run's
own counts: a drafted token is accepted exactly when the sampled token equals it (the rejection rule's residual
excludes the rejected draft), so the sampled path fixes every step's accepted count. The one thing a replay cannot
see is what the engine verifies past a row's EOS inside a draft (those tokens are dropped from the completion but
counted in the logged acceptance); they are counted apart (`past_eos_drafted`) and the logged value must lie in
the bounds they leave. On the same paths the replay also answers counterfactuals: the other arm's rule, no history.
Which source each draft came from is read off the session's index (which source the matched n-gram points into):
history, sibling (another row of the same prompt), prompt, own (the row's own completion).

    python benchmarks/acceptance.py --out docs/acceptance                   # both tasks, both arms (~25 CPU min)
    python benchmarks/acceptance.py --out docs/acceptance --dry-run         # print the commands only
    python benchmarks/acceptance.py --out docs/acceptance --replay-only     # summary again from --work's runs

Outputs in --out: summary.json, summary.md, acceptance.png. The runs (and the recorded histories, tokens only) stay
in --work (default /tmp/qerl-acceptance), not in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TAIL_ROWS = 8  # rollout.speculative_rows' default: the tail-only arm
MAX_DRAFT = 7  # rollout.speculative_draft's default (unchanged by these runs)


@dataclass
class Task:
    name: str
    overrides: list[str]
    prompts_per_step: int
    group_size: int
    n: int
    max_new_tokens: int
    steps: int

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.group_size

    def epoch(self, step: int) -> int:
        """The epoch (1-based) a 1-based step belongs to."""
        return (step * self.prompts_per_step - 1) // self.n + 1


def tasks(args) -> dict[str, Task]:
    arith = Task("arithmetic", [f"data.n={args.arith_n}", f"rollout.prompts_per_step={args.arith_prompts}"],
                 args.arith_prompts, 8, args.arith_n, 24, args.arith_steps)
    gsm = Task("gsm8k", ["data.name=gsm8k", "data.path=data/gsm8k/train.jsonl", f"data.n={args.gsm_n}",
                         "data.system_prompt=null", f"rollout.prompts_per_step={args.gsm_prompts}",
                         f"rollout.group_size={args.gsm_group}", f"rollout.max_new_tokens={args.gsm_tokens}"],
               args.gsm_prompts, args.gsm_group, args.gsm_n, args.gsm_tokens, args.gsm_steps)
    return {"arithmetic": arith, "gsm8k": gsm}


def shell(argv: list[str]) -> str:
    """The command as one would type it (an argument with a single quote in double quotes)."""
    return " ".join(f'"{a}"' if "'" in a and '"' not in a and "$" not in a else shlex.quote(a) for a in argv)


def arm_rows(task: Task, arm: str) -> int:
    return task.rows if arm == "whole" else TAIL_ROWS


def train_args(task: Task, arm: str, out: Path) -> list[str]:
    # 'on' quoted: unquoted, YAML reads `on` as the boolean true, which rollout.speculative refuses
    sets = task.overrides + ["rollout.speculative='on'", f"rollout.speculative_rows={arm_rows(task, arm)}",
                             f"train.steps={task.steps}", "train.save_every=1"]
    argv = ["train", "--params", "params/default.yaml", "--out", str(out), "--overwrite"]
    for s in sets:
        argv += ["-S", s]
    return argv


# ------------------------------------------------------------------------------------------------------ the runs

def run_training(task: Task, arm: str, folder: Path) -> float:
    """`qerl train` in a subprocess, its output passed on; copies each checkpoint's draft history as it appears
    (only the two newest checkpoints are kept). Returns the run's CPU seconds (user + system)."""
    from qerl.run import safestate

    run_dir, rec_dir = folder / "run", folder / "histories"
    shutil.rmtree(rec_dir, ignore_errors=True)
    rec_dir.mkdir(parents=True)
    argv = train_args(task, arm, run_dir)
    print(f"[{task.name}/{arm}] qerl {shell(argv)}", flush=True)
    start, commit = os.times(), git_head()
    proc = subprocess.Popen([sys.executable, "-m", "qerl.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)

    def forward():
        for line in proc.stdout:
            if " qerl.rl.trainer: step " in line or "error" in line.lower() or "qerl:" in line:
                print(f"[{task.name}/{arm}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    seen: set[str] = set()

    def collect():
        root = run_dir / "checkpoints"
        for ckpt in sorted(root.glob("step-*")) if root.is_dir() else []:
            if ckpt.name in seen or not (ckpt / "manifest.json").is_file():
                continue
            try:
                state = safestate.load(ckpt / "trainer_state.json", ckpt / "trainer_state.safetensors")
            except Exception:  # noqa: BLE001 - removed under us (the run keeps two): try the next poll
                continue
            seen.add(ckpt.name)
            drafts = state.get("drafts")
            history = history_lists(drafts) if drafts is not None else []
            (rec_dir / f"{int(state['step']):06d}.json").write_text(json.dumps(history))

    while proc.poll() is None:
        collect()
        time.sleep(0.3)
    collect()
    reader.join(timeout=5)
    used = os.times()
    cpu = (used.children_user - start.children_user) + (used.children_system - start.children_system)
    if proc.returncode != 0:
        raise SystemExit(f"[{task.name}/{arm}] qerl train exited {proc.returncode}")
    missing = [s for s in range(1, task.steps + 1) if not (rec_dir / f"{s:06d}.json").is_file()]
    if missing:
        raise SystemExit(f"[{task.name}/{arm}] no draft history recorded for steps {missing} (checkpoint missed)")
    (folder / "cpu_seconds.json").write_text(json.dumps({"cpu_s": cpu, "commit": commit}))
    return cpu


def history_lists(state) -> list[list]:
    """A DraftHistory state_dict as [[prompt ids, [completion ids, ...]], ...] in its order (oldest-added first)."""
    pt, po = state["prompt_tokens"].tolist(), state["prompt_offsets"].tolist()
    ct, co = state["completion_tokens"].tolist(), state["completion_offsets"].tolist()
    out, c = [], 0
    for p, count in enumerate(state["counts"].tolist()):
        comps = [ct[co[i]:co[i + 1]] for i in range(c, c + count)]
        c += count
        out.append([pt[po[p]:po[p + 1]], comps])
    return out


def load_history(entries):
    from qerl.rollout.drafts import DraftHistory

    h = DraftHistory()
    for prompt, comps in entries:
        for comp in comps:
            h.add(prompt, comp)
    return h


# ---------------------------------------------------------------------------------------------------- the replay

KINDS = ("history", "sibling", "prompt", "own")


def tracing_session_class():
    from qerl.rollout import drafts as D

    class TracingSession(D.DraftSession):
        """A DraftSession that also says which source its last draft came from (read off its index: which source
        the matched n-gram's continuation lies in). Uses the session's internals; the drafts are the parent's."""

        def propose(self, row, k):
            draft = super().propose(row, k)
            self.kind = None
            if draft:
                group, window = self._group_of[row], tuple(self._sequences[row][-self.n_max:])
                found = next(f for f in (group.index.get(window[cut]) for cut in self._cuts) if f is not None)
                source = found // D._STRIDE
                if source == 0:
                    self.kind = "prompt"
                elif source <= len(group.history):
                    self.kind = "history"
                else:
                    self.kind = "own" if source * D._STRIDE == self._base[row] else "sibling"
            return draft

    return TracingSession


@dataclass
class Counts:
    verify_row_steps: int = 0
    spec_tokens: int = 0
    tokens: int = 0  # every completion token of the step (speculated or not)
    drafted: int = 0
    accepted: int = 0
    past_eos_drafted: int = 0  # drafted past the EOS of a fully matched row: the engine's verdict on them unseen
    by_kind: dict = field(default_factory=lambda: {k: [0, 0] for k in KINDS})  # kind -> [drafted, accepted]

    def add(self, o: "Counts") -> None:
        for name in ("verify_row_steps", "spec_tokens", "tokens", "drafted", "accepted", "past_eos_drafted"):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        for k in KINDS:
            self.by_kind[k][0] += o.by_kind[k][0]
            self.by_kind[k][1] += o.by_kind[k][1]

    def summary(self) -> dict:
        d = self.drafted
        return {"acceptance": round(self.accepted / d, 4) if d else None,
                "tokens_per_step": round(self.spec_tokens / self.verify_row_steps, 4) if self.verify_row_steps
                else None,
                "token_share": round(self.spec_tokens / self.tokens, 4) if self.tokens else None,
                "drafted": d, "accepted": self.accepted, "past_eos_drafted": self.past_eos_drafted,
                "verify_row_steps": self.verify_row_steps, "spec_tokens": self.spec_tokens, "tokens": self.tokens,
                "by_source": {k: {"drafted": v[0], "accepted": v[1],
                                  "acceptance": round(v[1] / v[0], 4) if v[0] else None,
                                  "share_of_accepted": round(v[1] / self.accepted, 4) if self.accepted else None}
                              for k, v in self.by_kind.items()}}


def engine_query_cost() -> float | None:
    """`RolloutEngine.verify_token_cost` where the engine chooses each step's query count by it (commit 482c571,
    `SpeculativeRows.queries`), read from the source without building an engine; None for an engine that verifies
    every draft in full."""
    import re

    from qerl.rollout import engine, speculation

    if not hasattr(speculation.SpeculativeRows, "queries"):
        return None
    found = re.search(r"self\.verify_token_cost = ([0-9.eE+-]+)", Path(engine.__file__).read_text())
    return float(found.group(1)) if found else None


def choose_queries(rows: list[dict], drafts: list[list[int]], live_rows: int, cost: float) -> int:
    """`SpeculativeRows.queries` (482c571): the query count with the most expected tokens per unit of step cost,
    from each row's acceptance estimate (accepted + 1) / (accepted + rejections + 2). The reference engine's bucket
    is the live row count (exact: compacted whenever a row finishes)."""
    longest = max(map(len, drafts))
    rates = [min((r["acc"] + 1) / (r["acc"] + r["rej"] + 2), 0.999) for r in rows]
    best, best_t = -1.0, 1
    for t in (1, 2, 4, 8):
        if t // 2 > longest:
            break
        gain = sum((1 - a ** (min(len(d), t - 1) + 1)) / (1 - a) for a, d in zip(rates, drafts))
        value = gain / (1 + cost * live_rows * t)
        if value > best:
            best, best_t = value, t
    return best_t


def replay(prompts, completions, history, max_new: int, spec_rows: int, use_history: bool = True,
           finished_rows: bool = False, query_cost: float | None = None) -> Counts:
    """The engine's speculative loop (RolloutEngine._run / _speculate, SpeculativeRows.step, Row.adapt) on the
    sampled `completions` of one call: when it switches to speculation, what each row drafts, how much of it the
    sampled path accepts. `history`: the DraftHistory the call drafted from. `finished_rows`: a counterfactual, the
    rows that finished before the switch handed to the session too (the engine hands it the live rows only).
    `query_cost`: cut the drafts to the query count `choose_queries` picks (the engine since 482c571); None: every
    draft verified in full (the engine before it: what the drafts themselves are worth)."""
    session = tracing_session_class()(history if use_history else None, prompts)
    lengths = [len(c) for c in completions]
    counts = Counts(tokens=sum(lengths))
    switch = None
    for step in range(max_new - 1):  # the plain loop checks after drawing token `step`; never at the last one
        live = [i for i, n in enumerate(lengths) if n - 1 > step]  # a row is done once its EOS is drawn
        if not live:
            break
        if len(live) <= spec_rows:
            switch = step
            break
    if switch is None:
        return counts
    rows = [{"i": i, "count": switch + 1, "draft_len": min(4, MAX_DRAFT), "acc": 0, "rej": 0} for i in live]
    if finished_rows:
        for i, n in enumerate(lengths):
            if i not in live:
                session.extend(i, completions[i])
    for r in rows:  # the engine hands the live rows' tokens so far to the session (finished rows: none)
        session.extend(r["i"], completions[r["i"]][:r["count"]])
    while rows:
        proposals = []
        for r in rows:  # every row proposes, then every row extends (one verify forward between)
            d = session.propose(r["i"], min(r["draft_len"], max_new - r["count"]))
            proposals.append((d, session.kind))
        if query_cost is not None:
            t = choose_queries(rows, [d for d, _ in proposals], len(rows), query_cost)
            proposals = [(d[:t - 1], kind) for d, kind in proposals]
        counts.verify_row_steps += len(rows)
        for r, (d, kind) in zip(rows, proposals):
            rest = completions[r["i"]][r["count"]:]
            a = 0
            while a < min(len(d), len(rest)) and d[a] == rest[a]:
                a += 1
            if a == len(rest) and len(d) > a:  # matched through the row's EOS; the engine verified more
                counts.past_eos_drafted += len(d) - a
            emitted = rest[:a + 1]
            counts.drafted += len(d)
            counts.accepted += a
            counts.spec_tokens += len(emitted)
            if d:
                counts.by_kind[kind][0] += len(d)
                counts.by_kind[kind][1] += a
            r["acc"] += a
            r["rej"] += a < len(d)
            if d:
                r["draft_len"] = min(MAX_DRAFT, r["draft_len"] + 2) if a == len(d) else max(1, a + 1)
            r["count"] += len(emitted)
            session.extend(r["i"], emitted)
        rows = [r for r in rows if r["count"] < lengths[r["i"]]]
    return counts


def step_calls(task: Task, rec_dir: Path):
    """(step, prompts, completions, history before) for each recorded step, checked: the history before plus the
    step's completions in row order is exactly the recorded history after."""
    before = []
    for step in range(1, task.steps + 1):
        after = json.loads((rec_dir / f"{step:06d}.json").read_text())
        mine = after[-task.prompts_per_step:]  # re-inserted on add: the step's prompts are the newest, in row order
        prompts, completions = [], []
        for prompt, comps in mine:
            for comp in comps[-task.group_size:]:
                prompts.append(prompt)
                completions.append(comp)
        check = load_history(before)
        for p, c in zip(prompts, completions):
            check.add(p, c)
        if history_lists(check.state_dict()) != after:
            raise SystemExit(f"{rec_dir}: step {step}'s completions do not rebuild its recorded history")
        yield step, prompts, completions, load_history(before)
        before = after


def analyse(task: Task, arm: str, folder: Path) -> dict:
    """Per step: the logged metrics, the replay of the engine as it is (which must reproduce them), and per epoch
    the counterfactual replays on the same sampled completions: each arm's rule with every draft verified in full
    (what the drafts are worth), with and without the history, and the tail with the finished rows as sources."""
    metrics = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines() if line]
    logged = {m["step"]: m for m in metrics}
    info = json.loads((folder / "cpu_seconds.json").read_text())
    cpu = info["cpu_s"]
    cost = engine_query_cost()
    steps, epochs = [], {}
    rules = {"whole": task.rows, "tail": TAIL_ROWS}
    for step, prompts, completions, history in step_calls(task, folder / "histories"):
        def again(spec_rows, **kw):
            return replay(prompts, completions, history, task.max_new_tokens, spec_rows, **kw)

        engine = again(arm_rows(task, arm), query_cost=cost)
        m = logged[step]
        row = {"step": step, "epoch": task.epoch(step),
               "logged": {k.split("/")[1]: round(m[k], 4) for k in m if k.startswith("speculative/")},
               "response_length": round(m["response_length"], 2), "truncation_rate": round(m["truncation_rate"], 4),
               "reward_mean": round(m["reward_mean"], 4), "seconds_rollout": round(m["seconds_rollout"], 1),
               "rows_at_token_limit": sum(len(c) == task.max_new_tokens for c in completions),
               "replay_engine": engine.summary(), "replay_full": again(arm_rows(task, arm)).summary()}
        # the replay reproduces the logged counts (the logged acceptance also counts drafts verified past an EOS,
        # and reads 0 where nothing was drafted)
        lg, rp = row["logged"], engine
        if rp.verify_row_steps:
            lo = rp.accepted / (rp.drafted + rp.past_eos_drafted) if rp.drafted else 0.0
            hi = (rp.accepted + rp.past_eos_drafted) / (rp.drafted + rp.past_eos_drafted) if rp.drafted else 0.0
            ok = (abs(lg.get("tokens_per_step", -1) - rp.spec_tokens / rp.verify_row_steps) < 1e-3
                  and abs(lg.get("token_share", -1) - rp.spec_tokens / rp.tokens) < 1e-3
                  and lo - 1e-3 <= lg.get("acceptance", -1) <= hi + 1e-3)
        else:
            ok = not lg
        row["replay_matches_log"] = ok
        e = epochs.setdefault(task.epoch(step), {})
        e.setdefault("engine", Counts()).add(engine)
        for rule, spec_rows in rules.items():
            for h in (True, False):
                e.setdefault(f"{rule}{'' if h else '_no_history'}", Counts()).add(again(spec_rows, use_history=h))
        e.setdefault("tail_with_finished_rows", Counts()).add(again(TAIL_ROWS, finished_rows=True))
        steps.append(row)
    return {"task": task.name, "arm": arm, "speculative_rows": arm_rows(task, arm), "rows": task.rows,
            "command": "qerl " + shell(train_args(task, arm, Path(f"runs/acceptance/{task.name}-{arm}"))),
            "cpu_seconds": round(cpu, 1), "commit": info.get("commit"), "engine_query_cost": cost, "steps": steps,
            "epochs": {str(k): {name: c.summary() for name, c in v.items()} for k, v in epochs.items()},
            "replay_matches_log": all(s["replay_matches_log"] for s in steps)}


# --------------------------------------------------------------------------------------------------- the outputs

def fmt(x, digits=3):
    return "—" if x is None else f"{x:.{digits}f}"


def markdown(summary: dict) -> str:
    cost = summary["runs"][0]["engine_query_cost"] if summary["runs"] else None
    chooser = (f"the engine picks each step's query count by expected tokens per unit of step cost "
               f"(`verify_token_cost` {cost}, SpeculativeRows.queries)" if cost is not None
               else "the engine verifies every draft in full")
    lines = [f"# Draft acceptance of speculative rollouts, {summary['date']}", "",
             f"{summary['machine']}. Model: {summary['model']}. Temperature 1, `speculative_draft` {MAX_DRAFT}; "
             f"{chooser}. Acceptance = accepted / drafted draft tokens; tokens/step = tokens a row gains per verify "
             "step (1 + accepted); share = the rollout's tokens that speculative steps produced.", "",
             "*Logged*: the runs' metrics.jsonl, what the engine did (summed over the epoch's steps by the replay "
             "that reproduces them exactly: `replay_matches_log`). *Drafts in full*: the same sampled completions "
             "replayed with every draft verified (the engine before 482c571): what the drafts are worth. "
             "*No history*: the same without the DraftHistory (siblings, prompt and own text only).", ""]
    lines += ["| task | arm | epoch | logged acceptance | logged tokens/step | drafts in full: acceptance "
              "| tokens/step | share | no history: acceptance | tokens/step | accepted from history / siblings / "
              "prompt / own |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        for epoch, e in r["epochs"].items():
            eng, full, noh = e["engine"], e[r["arm"]], e[r["arm"] + "_no_history"]
            src = full["by_source"]
            split = " / ".join(fmt(src[k]["share_of_accepted"], 2) for k in KINDS) if full["accepted"] else "—"
            lines.append(f"| {r['task']} | {r['arm']} ({r['speculative_rows']} of {r['rows']}) | {epoch} "
                         f"| {fmt(eng['acceptance'])} ({eng['drafted']} drafted) | {fmt(eng['tokens_per_step'])} "
                         f"| {fmt(full['acceptance'])} | {fmt(full['tokens_per_step'])} "
                         f"| {fmt(full['token_share'], 2)} | {fmt(noh['acceptance'])} | {fmt(noh['tokens_per_step'])} "
                         f"| {split} |")
    lines += ["", "Acceptance of each source's drafts (drafts in full, epochs 2 on, the run's own arm; drafted tokens "
              "in brackets):", "", "| task | arm | history | siblings | prompt | own |", "|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        agg = {k: [0, 0] for k in KINDS}
        for epoch, e in r["epochs"].items():
            if epoch != "1":
                for k in KINDS:
                    agg[k][0] += e[r["arm"]]["by_source"][k]["drafted"]
                    agg[k][1] += e[r["arm"]]["by_source"][k]["accepted"]
        cells = [f"{fmt(a / d if d else None)} ({d})" for d, a in agg.values()]
        lines.append(f"| {r['task']} | {r['arm']} | " + " | ".join(cells) + " |")
    lines += ["", "Rows that reached `max_new_tokens` per step (the tail-only arm speculates only once at most "
              f"{TAIL_ROWS} rows are live):", ""]
    for r in summary["runs"]:
        lines.append(f"- {r['task']}/{r['arm']}: " + ", ".join(f"{s['rows_at_token_limit']} of {r['rows']}"
                                                             for s in r["steps"]))
    lines += ["", "Commands (from the repository root; `python benchmarks/acceptance.py --out docs/acceptance` runs "
              "them, with `--out` in a scratch folder, and replays them):", ""]
    for r in summary["runs"]:
        lines.append(f"- {r['task']}/{r['arm']} ({r['cpu_seconds']:.0f} CPU s): `{r['command']}`")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Acceptance and tokens per verify step per step: logged (what the engine did; no point where it drafted
    nothing) and with every draft verified (replay), per task and arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["task"] for r in summary["runs"]))
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 6.4), squeeze=False)
    nan = float("nan")
    for col, name in enumerate(names):
        for n, r in enumerate(r for r in summary["runs"] if r["task"] == name):
            xs = [s["step"] for s in r["steps"]]
            label = f"{r['arm']} ({r['speculative_rows']} of {r['rows']})"
            for row, key in enumerate(("acceptance", "tokens_per_step")):
                logged = [s["logged"].get(key, nan) if s["replay_engine"]["drafted"] else nan for s in r["steps"]]
                full = [s["replay_full"][key] if s["replay_full"][key] is not None else nan for s in r["steps"]]
                ax = axes[row][col]
                line, = ax.plot(xs, full, marker="o", linestyle="--", label=f"{label}: drafts in full (replay)")
                ax.plot(xs, logged, marker="s", color=line.get_color(), label=f"{label}: logged")
        for row, label in enumerate(("acceptance", "tokens per verify step")):
            ax = axes[row][col]
            ax.set_title(f"{name}: {label}", fontsize=10)
            ax.set_xlabel("step = epoch over the prompts" if summary["epoch_per_step"] else "step")
            ax.set_xticks([s["step"] for s in summary["runs"][0]["steps"]])
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_ylim(0, 1)
                ax.legend(fontsize=7)
            else:
                ax.set_ylim(0.95, None)
    fig.suptitle(f"Speculative rollouts, embedded SmolLM2-135M, temperature 1, {summary['date']} "
                 "(missing points: nothing drafted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def git_head() -> str:
    """The commit the runs were made at, with `+dirty` where qerl/ had uncommitted changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "qerl"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + ("+dirty" if dirty else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="summary.json, summary.md and acceptance.png go here")
    p.add_argument("--work", type=Path, default=Path("/tmp/qerl-acceptance"), help="the runs and recordings")
    p.add_argument("--tasks", default="arithmetic,gsm8k")
    p.add_argument("--arms", default="whole,tail")
    p.add_argument("--arith-n", type=int, default=8)
    p.add_argument("--arith-prompts", type=int, default=8)
    p.add_argument("--arith-steps", type=int, default=3)
    p.add_argument("--gsm-n", type=int, default=4)
    p.add_argument("--gsm-prompts", type=int, default=4)
    p.add_argument("--gsm-group", type=int, default=4)
    p.add_argument("--gsm-tokens", type=int, default=128)
    p.add_argument("--gsm-steps", type=int, default=3)
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--machine", default=f"CPU, {os.cpu_count()} cores (model.cpu_threads 2)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--replay-only", action="store_true", help="summarise the runs already in --work")
    args = p.parse_args(argv)
    chosen = [tasks(args)[t] for t in args.tasks.split(",")]
    arms = args.arms.split(",")
    if any(a not in ("whole", "tail") for a in arms):
        p.error("--arms: whole and/or tail")
    if args.dry_run:
        for t in chosen:
            for a in arms:
                print("qerl " + shell(train_args(t, a, args.work / f"{t.name}-{a}" / "run")))
        return 0
    runs, t0 = [], time.time()
    for t in chosen:
        for a in arms:
            folder = args.work / f"{t.name}-{a}"
            if not args.replay_only:
                cpu = run_training(t, a, folder)
                print(f"[{t.name}/{a}] done: {cpu:.0f} CPU s; {time.time() - t0:.0f} s wall so far", flush=True)
            runs.append(analyse(t, a, folder))
            r = runs[-1]
            for epoch, e in r["epochs"].items():
                print(f"[{t.name}/{a}] epoch {epoch}: engine acceptance {fmt(e['engine']['acceptance'])} "
                      f"tokens/step {fmt(e['engine']['tokens_per_step'])}; drafts in full: acceptance "
                      f"{fmt(e[a]['acceptance'])} tokens/step {fmt(e[a]['tokens_per_step'])}", flush=True)
            print(f"[{t.name}/{a}] replay matches log: {r['replay_matches_log']}", flush=True)
    summary = {"date": args.date, "machine": args.machine,
               "model": "embedded SmolLM2-135M-Instruct, NVFP4 base + LoRA r16 (params/default.yaml)",
               "epoch_per_step": all(t.n == t.prompts_per_step for t in chosen), "max_draft": MAX_DRAFT,
               "tasks": {t.name: {"n": t.n, "prompts_per_step": t.prompts_per_step, "group_size": t.group_size,
                                  "max_new_tokens": t.max_new_tokens, "steps": t.steps} for t in chosen},
               "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "summary.md").write_text(markdown(summary))
    plot(summary, args.out / "acceptance.png")
    print(f"wrote {args.out}/summary.json, summary.md, acceptance.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
