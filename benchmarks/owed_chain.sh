#!/usr/bin/env bash
# What issues #61, #63 and #64 owed on a GPU after 2026-12-02's third session (.notes/engine.md), as two device calls
# back to back on one machine (nothing carried; each call stands alone):
#
#   run(carry=[], timeout_s=600, command="bash benchmarks/owed_chain.sh tests")   # ~5 min
#   run(carry=[], timeout_s=600, command="bash benchmarks/owed_chain.sh bench")   # ~8 min
#
# tests: #61's compile-count test with Dynamo's recompile reasons (TORCH_LOGS=recompiles), the FP8 base's CUDA tests
#        (#63 item 3), the multi-turn tests on CUDA (#64: the bucketed engine's verify graphs at one query per row,
#        extend_row on the fused cache).
# bench: rollouts of the FP8 base beside bf16 and NVFP4 at 1 / 8 / 64 / 512 rows x 256 new tokens (#63's target:
#        FP8 >= 1.25x bf16 at 1 and 8 rows, not below NVFP4 at 64-512); multi-turn against single-turn of the same
#        total length (#64's target: >= 0.9x); the GRPO step on the FP8 base beside bf16 (not below bf16's).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD QERL_GEMM_CACHE=$OUT/gemm_dispatch.json
START=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "${1:?usage: owed_chain.sh tests|bench|diag|verify|next|act-rollout|act-step|fp8-wide|sensitive-step}" in
  tests)
    TORCH_LOGS=recompiles timeout -s INT -k 10 200 python3 -m pytest -q -rfE -p no:cacheprovider \
      "tests/test_gpu_cli.py::test_gpu_train_on_a_fresh_machine_compiles_in_workers" 2>&1 | tee "$OUT/compile.log" | tail -60
    timeout -s INT -k 10 $(left 570) python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 \
      tests/test_quant_fp8.py tests/test_fp8_kernels.py tests/rollout/test_multi_turn.py \
      "tests/test_update_kernels.py::test_gpu_fp8_update_agrees_with_bf16_and_runs_fp8" 2>&1 \
      | tee "$OUT/tests.log" | tail -30
    timeout -s INT -k 10 $(left 585) python3 -m pytest -q -rfE -p no:cacheprovider tests/rollout/test_engine.py \
      -k "gpu and fp8" 2>&1 | tee -a "$OUT/tests.log" | tail -15 ;;
  diag)  # 2026-12-03: what the trainer compiles that its workers did not; the FP8 and multi-turn failures in full
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    QERL_OPS_LOG=$OUT/ops.jsonl PYTHONPATH=$PWD/benchmarks/diag:$PWD TORCH_LOGS=recompiles timeout -s INT -k 10 240 \
      python3 -m pytest -q -rfE -p no:cacheprovider \
      "tests/test_gpu_cli.py::test_gpu_train_on_a_fresh_machine_compiles_in_workers" > "$OUT/compile.log" 2>&1
    tail -5 "$OUT/compile.log"
    timeout -s INT -k 10 $(left 560) python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_quant_fp8.py tests/test_fp8_kernels.py \
      "tests/rollout/test_multi_turn.py::test_gpu_a_resumed_rows_continuation_is_the_policys_on_the_graphed_engine" \
      > "$OUT/tests.log" 2>&1
    tail -15 "$OUT/tests.log"
    timeout $(left 590) python3 benchmarks/bench_multiturn.py --model 7b --scheme nvfp4 --batch 64 --turns 3 \
      --turn-tokens 256 --answer-tokens 48 --latency 0.5 --phases --probe 2>&1 | tee "$OUT/multiturn.log" | tail -12 ;;
  verify)  # 2026-12-03: the fixes of the diag call, one tool-turn prefill profiled, #61's rollouts before/after
    bash benchmarks/owed_chain.sh diag
    timeout 120 python3 benchmarks/diag/sweep_w8a16.py > "$OUT/sweep_w8a16.log" 2>&1; tail -14 "$OUT/sweep_w8a16.log"
    for tree in before after; do  # .before: git archive de5b8c6 (before #61) qerl kernels tasks flows ... (header)
      dir=$PWD; [ $tree = before ] && dir=$PWD/.before
      (cd "$dir" && PYTHONPATH=$dir timeout 150 python3 benchmarks/bench_rollout.py --models 7b --schemes nvfp4 \
         --batches 64,256 --new 1024 --out "$OUT/rollout-$tree") 2>&1 | sed "s/^/[$tree] /" \
        | tee -a "$OUT/rollout.log" | grep -v "^\[.*\]   (" | tail -8
    done ;;
  next)  # after 2026-12-03 (.notes/engine.md): what that session built and could not run; ~8 min
    timeout -s INT -k 10 150 python3 -m pytest -q -rfE -p no:cacheprovider \
      "tests/test_gpu_cli.py::test_gpu_train_on_a_fresh_machine_compiles_in_workers" \
      "tests/test_update_kernels.py::test_gpu_fused_elementwise_ops_match_eager" tests/test_quant_remedies.py \
      tests/rollout/test_multi_turn.py tests/rollout/test_rows.py 2>&1 | tee "$OUT/tests.log" | tail -12
    timeout 150 python3 benchmarks/bench_multiturn.py --model 7b --scheme nvfp4 --batch 64 --turns 3 \
      --turn-tokens 256 --answer-tokens 48 --latency 0.5 --phases --out "$OUT/multiturn" 2>&1 \
      | tee "$OUT/multiturn.log" | tail -10
    [ "${SWEEP:-0}" = 1 ] && { timeout 100 python3 benchmarks/diag/sweep_w8a16.py > "$OUT/sweep_w8a16.log" 2>&1;
      tail -14 "$OUT/sweep_w8a16.log"; }  # the W8A16 tile sweep: SWEEP=1 (2026-12-03, second session: left out for time)
    for tree in before after; do  # .before: git archive de5b8c6 qerl kernels tasks flows pyproject.toml benchmarks params
      dir=$PWD; [ $tree = before ] && dir=$PWD/.before
      (cd "$dir" && PYTHONPATH=$dir timeout 90 python3 benchmarks/bench_rollout.py --models 7b --schemes nvfp4 \
         --batches 64 --new 1024 --out "$OUT/rollout-$tree") 2>&1 | sed "s/^/[$tree] /" \
        | tee -a "$OUT/rollout.log" | grep -v "^\[.*\]   (" | tail -6
    done ;;
  bench)
    timeout 230 python3 benchmarks/bench_rollout.py --models 7b --schemes bf16,nvfp4,fp8 --batches 1,8,64,512 \
      --new 256 --out "$OUT/rollout" 2>&1 | tee "$OUT/rollout.log" | grep -v "^  (" | tail -30
    timeout 150 python3 benchmarks/bench_multiturn.py --model 7b --scheme nvfp4 --batch 64 --turns 3 \
      --turn-tokens 256 --answer-tokens 48 --latency 0.5 --out "$OUT/multiturn" 2>&1 | tee "$OUT/multiturn.log" | tail -25
    timeout $(left 585) python3 benchmarks/bench_grpo_step.py --models 7b --schemes fp8,bf16 --prompts 8 --micro 8 \
      --new 1024 --lengths gsm8k --steps 2 --out "$OUT/step" 2>&1 | tee "$OUT/step.log" | grep -v "^  (" | tail -25 ;;
  act-rollout)  # 2026-12-04: what quant.fp8_activations: false costs in rollouts (#63 item 5), FP8 with the new W8A16 tile
    timeout 350 python3 benchmarks/bench_rollout.py --models 7b --batches 1,8,64,512 --new 256 --budget 330 \
      --schemes bf16,nvfp4,nvfp4-bf16-act,fp8,fp8-bf16-act --out "$OUT/rollout" 2>&1 | tee "$OUT/rollout.log" \
      | grep -v "^  (" | tail -40 ;;
  act-step)  # ... and in the step a user runs, on ragged (gsm8k-traced) rollouts, each arm its own process
    timeout 350 python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4,fp8 --prompts 8 --micro 8 \
      --new 1024 --lengths gsm8k --steps 2 --budget 330 --variants 'w8a8:;bf16-act:quant.fp8_activations=false' \
      --out "$OUT/step" 2>&1 | tee "$OUT/step.log" | grep -v "^  (" | tail -30 ;;
  fp8-wide)  # 2026-12-04: the FP8 base's W8A16 past decode sizes (the wide tile, the one-pass dequantize), then what
    # it changes in rollouts and the ragged step with 16-bit activations, beside bf16 and W8A8
    timeout 90 python3 benchmarks/diag/sweep_w8a16_wide.py 2>&1 | tee "$OUT/sweep_wide.log" | tail -24
    timeout $(left 200) python3 benchmarks/bench_rollout.py --models 7b --batches 1,8,64,512 --new 256 \
      --budget $(( $(left 185) )) --schemes bf16,fp8-bf16-act,fp8 --out "$OUT/rollout" 2>&1 \
      | tee "$OUT/rollout.log" | grep -v "^  (" | tail -16
    timeout $(left 290) python3 benchmarks/bench_grpo_step.py --models 7b --schemes fp8 --prompts 8 --micro 8 \
      --new 1024 --lengths gsm8k --steps 2 --budget $(left 280) --variants 'bf16-act:quant.fp8_activations=false' \
      --out "$OUT/step" 2>&1 | tee "$OUT/step.log" | grep -v "^  (" | tail -4 ;;
  sensitive-step)  # owed (#63): the 7B cost of the README's advice for small models, down/v_proj in FP8 on NVFP4
    timeout 200 python3 benchmarks/bench_grpo_step.py --models 7b --schemes bf16 --prompts 8 --micro 8 \
      --new 1024 --lengths gsm8k --steps 2 --budget 190 --out "$OUT/step-bf16" 2>&1 | tee "$OUT/step-bf16.log" \
      | grep -v "^  (" | tail -3
    timeout $(left 580) python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --prompts 8 --micro 8 \
      --new 1024 --lengths gsm8k --steps 2 --budget $(left 560) \
      --variants 'default:;fp8-sensitive:quant.layer_schemes={"*.down_proj": fp8, "*.v_proj": fp8}' \
      --out "$OUT/step" 2>&1 | tee "$OUT/step.log" | grep -v "^  (" | tail -4 ;;
esac
