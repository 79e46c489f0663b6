#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see qerl/__init__.py: spinning OpenMP threads stall shared CPUs
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${QERL_SKIP_VENV:-0}" = "1" ] || . .venv/bin/activate
# Everything the run writes to the temp folder (pytest's tmp_path folders, DVC clones, quantized models, Prefect and
# MLflow stores: over a GB) goes into one folder of its own, removed when the run ends, whatever its outcome.
# QERL_KEEP_TMP=1 keeps it (its path is printed) to look at a failure.
scratch="$(mktemp -d "${TMPDIR:-/tmp}/qerl-test.XXXXXX")"
if [ "${QERL_KEEP_TMP:-0}" = "1" ]; then echo "temp folder kept: $scratch"; else trap 'rm -rf "$scratch"' EXIT; fi
export TMPDIR="$scratch"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi  # exit 5: nothing collected, not a failure
exit "$rc"
