#!/usr/bin/env bash
# Issue 50's GPU check in one device call: the CUDA tests of this tree, then rollout (and with `step`, the GRPO step)
# before and after the redesign, each arm its own process, interleaved so that drift on the machine hits both trees.
#
#   git archive 3d399ee qerl kernels tasks flows pyproject.toml benchmarks/bench_rollout.py \
#       benchmarks/bench_grpo_step.py params | tar -x -C .before        # the tree before issue 50 (git-ignored)
#   run(carry=[".whl", ".before"], command="bash benchmarks/before_after.sh tests rollout")
#   run(carry=[".whl", ".before"], command="bash benchmarks/before_after.sh step shared128 bf16")
#
# `tests`: pytest stopped by SIGINT at its budget still prints what failed so far (a SIGKILL prints nothing).
#
# One-row rollouts read 286 tok/s at ccdf029 (2026-11-27's table, 7B NVFP4, H200) and 183 on 2026-11-28, with 8 rows
# unchanged. Most likely the later figure paid one-time work in its timed call (BENCHMARKS.md, "Beside vLLM,
# completed"). `profile1` settles whether any of it is per step: both trees' warm decode step at 1 and 8 rows, and
# where it goes (benchmarks/profile_rollout_rows.py, copied into the old tree; it times a rollout after a warm one):
#   rm -rf .before && mkdir .before && git archive ccdf029 qerl kernels tasks flows pyproject.toml benchmarks params \
#       | tar -x -C .before
#   run(carry=[".whl", ".before"], command="bash benchmarks/before_after.sh profile1")   # ~5 min
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
here=$PWD
arm() {  # tree scheme prompts variants: one bench_grpo_step call at 8 samples per prompt, 256 + 1,024 tokens
  local dir=$here; [ "$1" = before ] && dir=$here/.before
  (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH timeout 280 python3 benchmarks/bench_grpo_step.py --models 7b \
     --schemes "$2" --prompts "$3" --micro 8 --prompt 256 --new 1024 --steps 2 --variants "$4" --out "$OUT/step-$1") \
    2>&1 | sed "s/^/[$1] /" | tee -a "$OUT/step.log" | grep -v "^\[.*\]   (\|INFO"
}
for what in "$@"; do
  case "$what" in
    tests) PYTHONPATH=$here:$PYTHONPATH timeout -s INT -k 20 "${TESTS_S:-280}" python3 -m pytest -q -rfE \
             -p no:cacheprovider --durations=15 tests/test_gpu_cli.py tests/execution/test_plan.py tests/execution/test_fusion.py \
             tests/rollout/test_engine.py tests/test_lora.py tests/test_update_kernels.py tests/test_gemm_backends.py \
             tests/test_gluon_gemm.py tests/test_quant_formats.py tests/test_kernels.py 2>&1 | tee "$OUT/tests.log" ;;
    rollout) for scheme in nvfp4 bf16; do for tree in before after; do
               dir=$here; [ $tree = before ] && dir=$here/.before
               (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH timeout 150 python3 benchmarks/bench_rollout.py --models 7b \
                  --schemes $scheme --batches 64,256 --new 1024 --out "$OUT/rollout-$tree") 2>&1 \
                 | sed "s/^/[$tree] /" | tee -a "$OUT/rollout.log" | grep -v "^\[.*\]   (" ; done; done ;;
    profile1) cp benchmarks/profile_rollout_rows.py .before/benchmarks/
              for tree in before after; do
                dir=$here; [ $tree = before ] && dir=$here/.before
                (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH timeout 150 python3 benchmarks/profile_rollout_rows.py \
                   --model 7b --scheme nvfp4 --rows 1,8 --new 1024 --top 25) 2>&1 | grep -v "USDT\|dispatch: GEMM" \
                  | sed "s/^/[$tree] /" | tee -a "$OUT/profile1.log" ; done ;;
    step) arm before nvfp4 8 'default:'; arm after nvfp4 8 'default:' ;;          # issue 50: the step unchanged
    shared128) arm after nvfp4 16 'shared:;plain:model.share_prompts=false' ;;     # issue 48 at 128 rows
    bf16) arm after bf16 8 'default:' ;;                                          # the step against bf16 LoRA
    *) echo "unknown part $what (tests, rollout, profile1, step, shared128, bf16)" >&2; exit 2 ;;
  esac
done
