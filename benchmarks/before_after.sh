#!/usr/bin/env bash
# Issue 50's GPU check in one device call: the CUDA tests of this tree, then rollout (and with `step`, the GRPO step)
# before and after the redesign, each arm its own process, interleaved so that drift on the machine hits both trees.
#
#   git archive 3d399ee qerl kernels tasks flows pyproject.toml benchmarks/bench_rollout.py \
#       benchmarks/bench_grpo_step.py | tar -x -C .before        # the tree before issue 50 (git-ignored)
#   run(carry=[".whl", ".before"], command="bash benchmarks/before_after.sh tests rollout")
#   run(carry=[".whl", ".before"], command="bash benchmarks/before_after.sh step")
#
# `tests`: pytest stopped by SIGINT at its budget still prints what failed so far (a SIGKILL prints nothing).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
here=$PWD
for what in "$@"; do
  case "$what" in
    tests) PYTHONPATH=$here:$PYTHONPATH timeout -s INT -k 20 "${TESTS_S:-280}" python3 -m pytest -q -rfE \
             -p no:cacheprovider --durations=15 tests/test_gpu_cli.py tests/test_execution.py tests/test_fusion.py \
             tests/test_engine.py tests/test_lora.py tests/test_update_kernels.py tests/test_gemm_backends.py \
             tests/test_gluon_gemm.py tests/test_quant_formats.py tests/test_kernels.py 2>&1 | tee "$OUT/tests.log" ;;
    rollout) for scheme in nvfp4 bf16; do for tree in before after; do
               dir=$here; [ $tree = before ] && dir=$here/.before
               (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH timeout 150 python3 benchmarks/bench_rollout.py --models 7b \
                  --schemes $scheme --batches 64,256 --new 1024 --out "$OUT/rollout-$tree") 2>&1 \
                 | sed "s/^/[$tree] /" | tee -a "$OUT/rollout.log" | grep -v "^\[.*\]   (" ; done; done ;;
    step) for tree in before after; do
            dir=$here; [ $tree = before ] && dir=$here/.before
            variants='default:'; [ $tree = after ] && variants='default:;plain:model.share_prompts=false'
            (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH timeout 280 python3 benchmarks/bench_grpo_step.py --models 7b \
               --schemes nvfp4 --micro 8 --prompt 256 --new 1024 --steps 2 --variants "$variants" --out "$OUT/step-$tree") 2>&1 \
              | sed "s/^/[$tree] /" | tee -a "$OUT/step.log"; done ;;
    *) echo "unknown part $what (tests, rollout, step)" >&2; exit 2 ;;
  esac
done
