#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see qerl.cli.prepare_process: spinning OpenMP threads stall shared CPUs
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${QERL_SKIP_VENV:-0}" = "1" ] || . .venv/bin/activate
# Everything the run writes to the temp folder (pytest's tmp_path folders, DVC clones, quantized models, Prefect and
# MLflow stores: over a GB) goes into one folder of its own, removed when the run ends, whatever its outcome.
# QERL_KEEP_TMP=1 keeps it (its path is printed) to look at a failure.
scratch="$(mktemp -d "${TMPDIR:-/tmp}/qerl-test.XXXXXX")"
if [ "${QERL_KEEP_TMP:-0}" = "1" ]; then echo "temp folder kept: $scratch"; else trap 'rm -rf "$scratch"' EXIT; fi
export TMPDIR="$scratch"
# Two workers (pytest-xdist), one per CI core: the suite is mostly single-threaded Python and subprocesses, so one
# process used ~84% of one core. --dist loadfile keeps each file in one worker (its module fixtures built once);
# the files' durations balance within ~40 s of the ideal split. QERL_TEST_WORKERS=0 runs in this process.
workers="${QERL_TEST_WORKERS:-2}"
xdist=()
[ "$workers" = "0" ] || xdist=(-n "$workers" --dist loadfile)
# The 30 slowest tests are listed before the result line on every run, so that any CI log says where the time went
# (a 34-minute run on a busy machine left no way to tell the suite's own cost from the machine's load). A
# --durations of the caller's comes later and wins.
set +e
python -m pytest "${xdist[@]}" --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi  # exit 5: nothing collected, not a failure
exit "$rc"
