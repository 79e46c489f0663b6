#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the main job on the embedded default (params/default.yaml):
# RL-train LoRA on the NVFP4 SmolLM2 base with AQN, then evaluate the adapter on the held-out split.
# Extra arguments are -S overrides for both, e.g.  bash scripts/run.sh -S train.steps=10
set -euo pipefail
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see qerl/__init__.py: spinning OpenMP threads stall shared CPUs
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${QERL_SKIP_VENV:-0}" = "1" ] || . .venv/bin/activate
out=runs/default
qerl train --params params/default.yaml --out "$out" "$@" $( [ -d "$out/checkpoints" ] && echo --resume )
qerl eval --params params/default.yaml --adapter "$out/adapter" --out "$out/eval" "$@"
echo "reward curve: $out/reward_curve.png   metrics: $out/metrics.jsonl   eval: $out/eval/metrics.json"
