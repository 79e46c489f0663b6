"""What the README's commands write stays out of `git status`: every `--out`/`-o` folder its shell blocks name, and
the stores the pipeline creates in the working directory, are git-ignored. `qerl quantize ... --out
checkpoints/smollm2-nvfp4`, as the README wrote it, left 165 MB of untracked files in a first user's clone."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the pipeline writes where it runs without an --out: MLflow's default store and artifacts, `dvc plots show`'s
# page, the flows' run folders and quantized bases.
PIPELINE_WRITES = ["mlflow.db", "mlartifacts/x", "dvc_plots/index.html", "runs/tiny/20260101-000000/x",
                   "runs/quantized/x"]


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def output_paths(block: str) -> list[str]:
    """The relative paths after --out / -o in a block's commands (placeholders such as DIR or <run folder> aside)."""
    paths = []
    for line in block.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in a comment's prose
            continue
        for flag, value in zip(words, words[1:]):
            if flag in ("--out", "-o") and not value.startswith(("/", "<", "$", "-")) and not value.isupper():
                paths.append(value)
    return paths


def test_the_readmes_outputs_are_git_ignored():
    named = [path for block in shell_blocks((ROOT / "README.md").read_text()) for path in output_paths(block)]
    assert "checkpoints/smollm2-nvfp4" in named and "runs/default" in named  # the parse found the commands
    paths = [f"{path}/x" for path in named] + PIPELINE_WRITES
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(paths),
                             capture_output=True, text=True).stdout.splitlines()
    assert sorted(set(paths) - set(ignored)) == []
