#!/usr/bin/env bash
# One device call: install the optional GPU wheels carried in .whl/, run the GPU tests, then the benchmarks named
# in $BENCH (a ;-separated list of commands). Logs go to $OUT.
set -uo pipefail
# What PYTHONPATH already holds stays behind ours (vLLM staged by benchmarks/stage_vllm.sh, for one).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} QERL_GEMM_CACHE=$OUT/gemm_dispatch.json
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q ${PYTEST_ARGS:--x} -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log" | tail -25
fi
IFS=';' read -ra cmds <<< "${BENCH:-}"
for c in "${cmds[@]}"; do
  echo "== $c"
  eval "$c" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^  (" | tail -80
done
