#!/usr/bin/env bash
# The GPU work issue 46 owed after 2026-11-28's fourth session (.notes/vllm.md), as device calls back to back that
# stage vLLM on the way. All six ran in the fifth session (order 1, 2, 3, 6, 5, 4; 24.8 device minutes;
# BENCHMARKS.md top section); call 6 after 1-3 re-measures the vLLM backend's device peak after the wake fix.
# A machine keeps /tmp only 30 s after a call, so there is nothing to decide between calls 1-4: each has its budget
# inside its timeout, and what it found is read after the last. Calls 5 and 6 go as
# far as `status` says the budget allows (6 first: with call 2's engine arm it gives the issue's three step arms in
# one session; 5 is the 32B anchor's vLLM side).
#
#   run(carry=[".whl", ".vllm/1"], timeout_s=340, command="bash benchmarks/gpu_chain.sh 1")  # ~5 min
#   run(carry=[".whl", ".vllm/2"], timeout_s=390, command="bash benchmarks/gpu_chain.sh 2")  # ~4.5 min
#   run(carry=[".whl", ".vllm/3"], timeout_s=380, command="bash benchmarks/gpu_chain.sh 3")  # ~5.5 min
#   run(carry=[".whl"], timeout_s=480, command="bash benchmarks/gpu_chain.sh 4")             # ~6 min
#   run(carry=[".whl"], timeout_s=560, command="bash benchmarks/gpu_chain.sh 5")             # ~8 min
#   run(carry=[".whl"], timeout_s=460, command="bash benchmarks/gpu_chain.sh 6")             # ~6 min
#
# What each call settles:
#   1. qerl's arms of the 32B anchor (bf16 and NVFP4 + LoRA at 1 and 8 rows x 1,024; the model built in memory).
#   2. the folders vLLM loads: the 7B random checkpoint (bf16 and qerl quantize's NVFP4), the 32B as config only;
#      then our engine's step with rollout.top_p 0.95 beside top_p 1: row-keyed top-p sampling now takes the keyed
#      kernel (it took one generator call per row), so the two should be within a few percent. Its engine arm is
#      also the same-session baseline of call 6.
#   3. unpack; the export served by vLLM, judged by its log-probs against the export's fp32 function (the test
#      was rewritten after the greedy check failed on near-ties, 2026-11-28).
#   4. vLLM's arms of the 7B anchor without per-request seeds, at 64, 128 and 256 rows (the first table's vLLM
#      numbers there were low by up to ~15%: BENCHMARKS.md).
#   5. vLLM's arms of the 32B anchor (load_format dummy), at 1 and 8 rows.
#   6. the vLLM backend's step, a new LoRA id per step and the adapter reloaded in place (fixed: it reloaded at
#      every engine step), with the step's peak without the sleeping pool and without our FP8 copies (both fixed),
#      beside the device's own peak (NVML, the device peak GiB column): above ours by the CUDA context
#      and PyTorch's cache (a few GiB), no longer by vLLM's 41 GiB pool;
#      call 2's engine arm is their baseline of the same session (issue 46 asks for the three arms in one run).
# `.vllm/` comes from `bash benchmarks/stage_vllm.sh pack peers` (~3-6 min here); `.whl/` holds humming-kernels and
# liger-kernel (BENCHMARKS.md names the versions). Issue 49's peers need a session of their own:
# benchmarks/peers_chain.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
step="${1:?usage: gpu_chain.sh 1|2|3|4|5|6}"
bash benchmarks/stage_vllm.sh receive
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
[ -f /tmp/qerl-vllm/env ] && . /tmp/qerl-vllm/env && export PYTHONPATH=$PWD:$PYTHONPATH
log() { tee -a "$OUT/step$step.log" | grep -v -E "^  \(|dispatch: GEMM| INFO " | tail -60; }
# pytest stopped by SIGINT at its budget still prints what failed so far (a SIGKILL prints nothing)
tests() { timeout -s INT -k 20 "$1" python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 "${@:2}" 2>&1 | log; }
anchor() {  # BUDGET ARGS: bench_vllm.py, each arm its own process, into $OUT/anchor
  timeout "$1" python3 benchmarks/bench_vllm.py --out "$OUT/anchor" "${@:2}" 2>&1 | log
}
need_vllm() {
  [ -f /tmp/qerl-vllm/env ] || { echo "gpu_chain: vLLM is not unpacked (calls 1-3 back to back on a warm machine?)"; exit 1; }
}
step_arms() {  # BUDGET VARIANTS: bench_grpo_step's 7B NVFP4 step, 64 x (256 + 1,024), each variant its own process
  timeout "$1" python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --micro 8 --steps 2 \
    --out "$OUT/step" --variants "$2" 2>&1 | log
}
case "$step" in
  1) anchor 300 --model 32b --rows 1,8 --long "" --weights dummy --arms qerl-nvfp4,qerl-bf16 ;;
  2) timeout 120 python3 -c "
import sys; from pathlib import Path; sys.path.insert(0, 'benchmarks')
from bench_vllm import write_folder
write_folder('7b', Path('/tmp/qerl-vllm-bench')); write_folder('32b', Path('/tmp/qerl-vllm-bench'), 'dummy')" 2>&1 | log
     step_arms 230 'engine:;top-p:rollout.top_p=0.95' ;;
  3) need_vllm; tests 330 tests/test_gpu_vllm.py::test_our_export_served_by_vllm_computes_our_policy ;;
  4) need_vllm; anchor 450 --rows 64,128,256 --long "" --arms vllm-bf16,vllm-nvfp4 ;;
  5) need_vllm; anchor 530 --model 32b --rows 1,8 --long "" --weights dummy --arms vllm-nvfp4,vllm-bf16 ;;
  6) need_vllm; step_arms 420 'vllm:rollout.backend=vllm;vllm-reload:rollout.backend=vllm,rollout.vllm_lora_update=reload' ;;
  *) echo "gpu_chain: unknown step $step (1-6)" >&2; exit 2 ;;
esac
