"""scripts/readme_figures.py: the README's figures from the files a DVC run leaves."""

import json
import os
from pathlib import Path

from scripts.readme_figures import main


def job(root, rewards=(0.140625, 0.03125, 0.25)):
    """What `dvc repro` leaves, in miniature: 3 steps (AQN from step 2), 18 held-out questions."""
    train, evaluation = root / "runs/dvc/train", root / "runs/dvc/eval"
    for folder in (train, evaluation, root / "data"):
        folder.mkdir(parents=True)
    rows = [{"step": i + 1, "reward_mean": r, "entropy": 1.5 + i / 10, "response_length": 22 - i, "sigma": 0.01 * i,
             "seconds_rollout": 60.0 + i, "seconds_scoring": 0.1, "seconds_update": 40.0, "grader_timeouts": i // 2}
            for i, r in enumerate(rewards)]
    (train / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (train / "params.yaml").write_text("model:\n  path: embedded\n  cpu_threads: 2\n")
    (evaluation / "metrics.json").write_text(json.dumps({"accuracy": 5 / 18, "num_examples": 18, "num_samples": 1,
                                                         "truncation_rate": 0.5, "mean_completion_tokens": 18.9,
                                                         "seconds": 33.3}))
    (root / "dvc.lock").write_text("schema: '2.0'\n")
    (root / "data/fingerprint.json").write_text("{}")
    os.utime(root / "data/fingerprint.json", (1_000_000, 1_000_000))
    os.utime(evaluation / "metrics.json", (1_000_000 + 54 * 60, 1_000_000 + 54 * 60))


def test_the_figures_of_a_run(tmp_path, capsys):
    job(tmp_path)
    assert main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "held-out accuracy: 27.8% (5/18), truncation rate 0.500, 18.9 tokens per answer"
    assert out[1] == "reward per step (3 steps): 0.14, 0.03, 0.25"
    assert out[2] == "entropy per step (nats/token): 1.50, 1.60, 1.70"
    assert out[4] == "AQN: noise-free steps 1-1, sigma 0.01 at step 2 -> 0.02 at step 3"
    assert out[5] == "grader timeouts: 1 (each a completion scored 0)"
    assert out[6].startswith("step time: 1.7-1.7 min (sampling 60-62 s, update 40-40 s); all steps 5.1 min;")
    assert out[7].startswith("job wall time (data/fingerprint.json to runs/dvc/eval/metrics.json, set-up not "
                             "included): 54.0 min;")
    assert out[8] == 'numerics: model.cpu_threads 2 (README "Determinism")'


def test_a_missing_output_is_one_line_naming_it(tmp_path, capsys):
    job(tmp_path)
    (tmp_path / "runs/dvc/eval/metrics.json").unlink()
    assert main(["--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"readme_figures: error: {tmp_path / 'runs/dvc/eval/metrics.json'}: No such file or directory "
                   "(run bash scripts/run.sh first)"]


def test_the_readmes_pictures_carry_the_held_out_accuracy(tmp_path, capsys, monkeypatch):
    """The README's pictures were the trainer's PNGs, drawn before the evaluation: the held-out accuracy, the job's
    headline, was in neither. `--plots` draws them from the job's files with it."""
    from matplotlib.figure import Figure

    legends = {}
    real_savefig = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        legends[Path(path).name] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    job(tmp_path)
    assert main(["--root", str(tmp_path), "--plots", str(tmp_path / "docs")]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("picture: ")]
    assert printed == [f"picture: {tmp_path / 'docs' / name}" for name in
                       ("embedded_default_reward_curve.png", "embedded_default_training_curves.png")]
    assert all((tmp_path / "docs" / name).stat().st_size > 10_000 for name in
               ("embedded_default_reward_curve.png", "embedded_default_training_curves.png"))
    assert all("held-out accuracy (27.8% at step 3)" in legend for legend in legends.values()), legends
