#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default (params/default.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${QERL_SKIP_VENV:-0}" = "1" ] || . .venv/bin/activate
qerl eval --params params/default.yaml "$@"
