#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see qerl/__init__.py: spinning OpenMP threads stall shared CPUs
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${QERL_SKIP_VENV:-0}" = "1" ] || . .venv/bin/activate
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi  # exit 5: nothing collected, not a failure
exit "$rc"
