#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the main job on the embedded default (params/default.yaml) through DVC:
# prepare data -> quantize SmolLM2 to NVFP4 -> RL-train LoRA with AQN -> evaluate the adapter on the held-out split.
# Extra arguments go to `dvc repro` (e.g. --force). Without DVC: qerl train ... && qerl eval --adapter ... (README).
set -euo pipefail
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see qerl.cli.prepare_process: spinning OpenMP threads stall shared CPUs
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${QERL_SKIP_VENV:-0}" = "1" ] || . .venv/bin/activate
dvc repro "$@"
dvc metrics show
echo "reward curve: runs/dvc/train/reward_curve.png   per-step metrics: runs/dvc/train/metrics.jsonl"
echo "eval: runs/dvc/eval/metrics.json and samples.jsonl   compare experiments: dvc exp show / dvc plots show"
