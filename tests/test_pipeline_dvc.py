"""`dvc repro` on a fresh `git clone` of this repository (committed files only), with params/tiny.yaml standing in for
params/default.yaml; then `dvc metrics show`, `dvc plots show` and a one-parameter `dvc exp run -S`.

Slow on 2 cores (three stages load SmolLM2-135M): marked `slow`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.patience import patience

pytest.importorskip("dvc")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "qerl-test", "GIT_AUTHOR_EMAIL": "test@qerl",
       "GIT_COMMITTER_NAME": "qerl-test", "GIT_COMMITTER_EMAIL": "test@qerl"}


def run(repo: Path, *cmd: str, timeout: float = patience(1500), **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=repo, env={**ENV, **env}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def repro(tmp_path_factory):
    """A clone with the tiny parameter set, reproduced once for the whole module."""
    repo = tmp_path_factory.mktemp("dvc") / "qerl"
    run(ROOT, "git", "clone", "--quiet", str(ROOT), str(repo))
    shutil.copy(ROOT / "params" / "tiny.yaml", repo / "params" / "default.yaml")
    return repo, run(repo, "dvc", "repro")


def test_repro_runs_every_stage_and_tracks_outputs_with_dvc(repro):
    repo, proc = repro
    for stage in ("prepare", "quantize", "train", "evaluate"):
        assert f"Running stage '{stage}'" in proc.stdout
    metrics = json.loads((repo / "runs/dvc/eval/metrics.json").read_text())
    assert metrics["num_examples"] == 4 and 0 <= metrics["accuracy"] <= 1
    assert (repo / "runs/dvc/train/adapter/adapter_model.safetensors").is_file()
    assert len((repo / "runs/dvc/curves/curves.csv").read_text().splitlines()) == 1 + 2  # header + 2 steps
    assert (repo / "runs/dvc/curves/reward_curve.png").read_bytes() == (
        repo / "runs/dvc/train/reward_curve.png").read_bytes()

    lock = (repo / "dvc.lock").read_text()
    for out in ("runs/dvc/train/adapter", "runs/dvc/train/checkpoints", "runs/dvc/quantized", "data/prepared",
                "runs/dvc/curves/curves.csv"):
        assert f"path: {out}" in lock  # hashed by DVC (the train stage's outputs are not cached: dvc.yaml says why)
    status = run(repo, "git", "status", "--porcelain", "--untracked-files=all").stdout.splitlines()
    # git sees none of the outputs but the metrics, a git file once committed (dvc.yaml: `dvc exp show`'s baseline)
    assert all(line == " M runs/dvc/eval/metrics.json" for line in status if "runs/" in line), status
    assert not [line for line in status if "data/prepared" in line]
    # Only the data check reports itself: it looks at the data on every repro (always_changed), nothing else is stale.
    assert run(repo, "dvc", "status").stdout.split() == ["fingerprint:", "always", "changed"]


def test_metrics_and_plots_show(repro):
    repo, _ = repro
    shown = json.loads(run(repo, "dvc", "metrics", "show", "--json").stdout)
    assert "accuracy" in json.dumps(shown)
    plots = run(repo, "dvc", "plots", "show", "--json").stdout
    assert "reward_mean" in plots and "reward_curve.png" in plots
    run(repo, "dvc", "plots", "show", "-o", "plots-html")
    page = (repo / "plots-html" / "index.html").read_text()
    # offline: vega inlined from .dvc/plots_offline.html (DVC's own page loads it from a CDN), the PNGs local files
    assert "<script src=" not in page and "cdn.jsdelivr" not in page and "vegaEmbed(" in page
    images = re.findall(r'<img src="([^"]+)"', page.split("<body>", 1)[1])  # the plots, not the inlined code
    assert len(images) == 2 and all(src.startswith("data:image") or (repo / "plots-html" / src).is_file()
                                    for src in images), images


def test_qerl_eval_and_the_evaluate_stage_evaluate_one_base(repro):
    """The evaluate stage loads its base from the quantize stage's folder; a plain `qerl eval` quantizes the model in
    memory. Both are one base, so one truncation rate: the folder used to store the embeddings in bf16, and on the
    default params' first question one reply ended (truncation rate 0.0) where the other ran into the token limit
    (1.0). The embedded model's, since its replies stop within the limit (a tiny random model's never do)."""
    repo, _ = repro
    command = ["qerl", "eval", "--params", str(ROOT / "params" / "default.yaml"), "--limit", "1"]
    run(repo, *command, "--out", "in-memory")
    run(repo, *command, "-S", "quant.quantized_path=runs/dvc/quantized", "--out", "from-folder")
    metrics, samples = {}, {}
    for out in ("in-memory", "from-folder"):
        metrics[out] = json.loads((repo / out / "metrics.json").read_text())
        samples[out] = [(row["completion"], row["stop_reason"])
                        for row in map(json.loads, (repo / out / "samples.jsonl").read_text().splitlines())]
    assert samples["in-memory"] == samples["from-folder"]
    for key in ("accuracy", "truncation_rate", "mean_completion_tokens"):
        assert metrics["in-memory"][key] == metrics["from-folder"][key], key


@pytest.fixture(scope="module")
def experiments(repro):
    """Two experiments on the reproduced clone, committed as their baseline (as a user commits dvc.lock after a
    repro): one that changes only the evaluation, one that trains again."""
    repo, _ = repro
    run(repo, "git", "commit", "-qam", "the tiny parameters and their repro as the baseline")
    return {name: run(repo, "dvc", "exp", "run", "--name", name, "-S", f"params/default.yaml:{change}")
            for name, change in (("short-eval", "eval.max_new_tokens=8"), ("high-lr", "optim.lr=1e-3"))}


def test_the_readmes_way_back_to_the_baseline_leaves_git_status_clean(repro, experiments):
    """`dvc exp run` leaves the workspace as its experiment left it: DVC had rewritten params/default.yaml (the
    -S value in, nulls and quotes out), and the next quick start trained the last experiment's settings. The
    README's line after its experiments brings the committed params, lock and metrics back. ~10 s."""
    repo, _ = repro
    assert run(repo, "git", "status", "--porcelain", "--untracked-files=no").stdout.strip()  # the last experiment's
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if "# back to the baseline" in line)
    run(repo, "bash", "-c", line.split("#", 1)[0])
    assert run(repo, "git", "status", "--porcelain", "--untracked-files=no").stdout == ""
    assert (repo / "params/default.yaml").read_bytes() == (ROOT / "params/tiny.yaml").read_bytes()


def test_exp_run_with_one_parameter_reruns_only_what_depends_on_it(repro, experiments):
    repo, _ = repro
    proc = experiments["short-eval"]
    assert "Running stage 'evaluate'" in proc.stdout
    assert "Running stage 'train'" not in proc.stdout and "Running stage 'quantize'" not in proc.stdout
    assert "Running stage 'train'" in experiments["high-lr"].stdout
    table = run(repo, "dvc", "exp", "show", "--csv").stdout
    assert "eval.max_new_tokens" in table.splitlines()[0] and ",8," in table


def test_the_readmes_exp_show_command_shows_what_each_experiment_changed(repro, experiments):
    """Bare `dvc exp show` (and `--only-changed`) is wider than a terminal: the dependencies' hashes, the grader's
    name and versions, timings and timestamps pushed the changed parameter out of the table. The README's command,
    on a 150-column terminal, shows both experiments' parameter (and the accuracy where it differs). ~3 s."""
    repo, _ = repro
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("dvc exp show "))
    shown = run(repo, *shlex.split(line, comments=True), "--no-pager", COLUMNS="150").stdout
    for text in ("short-eval", "high-lr", "optim.lr", "0.001", "eval.max_new_tokens"):
        assert text in shown, shown
    assert "seconds" not in shown and "Created" not in shown, shown


def test_plots_diff_of_two_experiments_shows_both_curves(repro, experiments):
    """The train stage's run folder is not cached (a live run's safety), so its curves existed only in the workspace:
    `dvc plots diff` of two experiments could load neither. The cached copies in runs/dvc/curves it can. ~5 s."""
    repo, _ = repro
    shown = json.loads(run(repo, "dvc", "plots", "diff", "short-eval", "high-lr", "--json").stdout)
    assert not shown.get("errors"), shown["errors"]
    rows = shown["data"]["reward"][0]["content"]["data"]["values"]
    assert {rev: {int(r["step"]) for r in rows if r["rev"] == rev} for rev in ("short-eval", "high-lr")} == {
        "short-eval": {1, 2}, "high-lr": {1, 2}}, rows


def test_prepare_reruns_when_the_data_change_and_not_otherwise(tmp_path):
    """A CSV named only in the params: DVC cannot see it, the fingerprint stage can."""
    repo = tmp_path / "qerl"
    run(ROOT, "git", "clone", "--quiet", str(ROOT), str(repo))
    data = tmp_path / "problems.csv"
    data.write_text("Frage,Antwort\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    params = repo / "params" / "default.yaml"
    params.write_text(params.read_text().replace("data:\n  name: arithmetic\n", f"data:\n  name: {data}\n"
                                                 "  question_field: Frage\n  answer_field: Antwort\n"))
    assert "Running stage 'prepare'" in run(repo, "dvc", "repro", "prepare").stdout
    again = run(repo, "dvc", "repro", "prepare").stdout
    assert "Running stage 'fingerprint'" in again and "Stage 'prepare' didn't change, skipping" in again
    data.write_text("Frage,Antwort\nWhat is 1 + 1?,2\nWhat is 2 + 3?,5\n")
    assert "Running stage 'prepare'" in run(repo, "dvc", "repro", "prepare").stdout
    assert "What is 2 + 3?" in (repo / "data" / "prepared" / "train.jsonl").read_text()
