#!/usr/bin/env bash
# The GPU work owed after 2026-11-28 (third session; .notes/vllm.md), as four device calls back to back that stage
# vLLM (and the peers' packages) on the way. A machine keeps /tmp only 30 s after a call, so there is nothing to
# decide between the calls: each has its budget inside its timeout, and what it found is read after the last.
#
#   run(carry=[".whl", ".vllm/1"], timeout_s=400, command="bash benchmarks/gpu_chain.sh 1")  # ~6 min
#   run(carry=[".whl", ".vllm/2"], timeout_s=220, command="bash benchmarks/gpu_chain.sh 2")  # ~3 min
#   run(carry=[".whl", ".vllm/3"], timeout_s=560, command="bash benchmarks/gpu_chain.sh 3")  # ~9 min
#   run(carry=[".whl"], timeout_s=500, command="bash benchmarks/gpu_chain.sh 4")             # ~8 min
#
# With the machine's start (~2 min) and the gaps, ~28 of a session's 30 device minutes. What each call settles:
#   1. issue 50: the GPU tests its last changes owe (the precompile workers past humming's shape assert; the model
#      taking its KV caches, through test_engine's CUDA cases and a CLI run) and the qerl-only arm of #46's step.
#   2. the 7B folders the vLLM arms load (random bf16, and qerl quantize's NVFP4 of it: bench_grpo_step --folder).
#   3. unpack; issue 46's GPU tests (the export served by vLLM, merged and not; rollout.backend vllm trains, resumes
#      and evaluates), then the nf4-bnb CLI case (bitsandbytes comes with the peers' packages).
#   4. issue 46's step: rollout.backend vllm with a new LoRA id per step, and with the adapter reloaded in place.
# Issue 49's peers (TRL + vLLM colocated, Unsloth fast_inference) need a session of their own: benchmarks/peers_chain.sh.
# `.vllm/` comes from `bash benchmarks/stage_vllm.sh pack peers` (~3-6 min here); `.whl/` holds humming-kernels and
# liger-kernel (BENCHMARKS.md names the versions).
set -uo pipefail
cd "$(dirname "$0")/.."
step="${1:?usage: gpu_chain.sh 1|2|3|4}"
bash benchmarks/stage_vllm.sh receive
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
[ -f /tmp/qerl-vllm/env ] && . /tmp/qerl-vllm/env && export PYTHONPATH=$PWD:$PYTHONPATH
log() { tee -a "$OUT/step$step.log" | grep -v -E "^  \(|dispatch: GEMM| INFO " | tail -60; }
# pytest stopped by SIGINT at its budget still prints what failed so far (a SIGKILL prints nothing)
tests() { timeout -s INT -k 20 "$1" python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 "${@:2}" 2>&1 | log; }
step_arms() {  # BUDGET VARIANTS: bench_grpo_step's 7B NVFP4 step, 64 x (256 + 1,024), each variant its own process
  timeout "$1" python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --micro 8 --steps 2 \
    --out "$OUT/step" --variants "$2" 2>&1 | log
}
case "$step" in
  1) tests 240 tests/test_gpu_cli.py::test_gpu_train_on_a_fresh_machine_compiles_in_workers \
       "tests/test_gpu_cli.py::test_gpu_quantize_train_resume_eval_export[nvfp4-gluon]" tests/test_engine.py
     step_arms 120 'engine:' ;;
  2) timeout 150 python3 -c "
import sys; from pathlib import Path; sys.path.insert(0, 'benchmarks')
from bench_vllm import write_folder; write_folder('7b', Path('/tmp/qerl-vllm-bench'))" 2>&1 | log ;;
  3) [ -f /tmp/qerl-vllm/env ] || { echo "gpu_chain: vLLM is not unpacked (were calls 1-2 back to back?)"; exit 1; }
     # the backend first, and no -x: a failing export case (seen once, cause unseen) must not hide the backend's
     tests 400 tests/test_gpu_vllm.py::test_vllm_backend_trains_resumes_and_evaluates \
       tests/test_gpu_vllm.py::test_our_export_served_by_vllm_computes_our_policy
     tests 120 "tests/test_gpu_cli.py::test_gpu_quantize_train_resume_eval_export[nf4-bnb-auto]" ;;
  4) [ -f /tmp/qerl-vllm/env ] || { echo "gpu_chain: vLLM is not unpacked (a cold machine?)"; exit 1; }
     step_arms 470 'vllm:rollout.backend=vllm;vllm-reload:rollout.backend=vllm,rollout.vllm_lora_update=reload' ;;
  *) echo "gpu_chain: unknown step $step (1-4)" >&2; exit 2 ;;
esac
