#!/usr/bin/env bash
# The GPU work owed after 2026-11-28 (.notes/vllm.md), as one chain of device calls that stage vLLM on the way.
# A machine keeps /tmp only 30 s after a call, so the calls go back to back with nothing to decide between them:
#
#   run(carry=[".whl", ".vllm/1"], command="bash benchmarks/vllm_chain.sh 1")   # GPU tests of the tree (issue 50)
#   run(carry=[".whl", ".vllm/2"], command="bash benchmarks/vllm_chain.sh 2")   # speed after issue 50; #48's 2nd arm
#   run(carry=[".whl", ".vllm/3"], command="bash benchmarks/vllm_chain.sh 3")   # unpack vLLM; its GPU tests
#   run(carry=[".whl"], command="bash benchmarks/vllm_chain.sh 4")              # the anchor, vLLM's arms, no seeds
#   run(carry=[".whl"], command="bash benchmarks/vllm_chain.sh 5")              # the step with rollout.backend vllm
#
# `.vllm/` comes from `bash benchmarks/stage_vllm.sh pack`, `.whl/` holds humming-kernels and liger-kernel wheels
# (BENCHMARKS.md names the versions). Each step keeps well inside a call's 10 minutes and writes its logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
step="${1:?usage: vllm_chain.sh 1|2|3|4|5}"
bash benchmarks/stage_vllm.sh receive
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
[ -f /tmp/qerl-vllm/env ] && . /tmp/qerl-vllm/env && export PYTHONPATH=$PWD:$PYTHONPATH
log() { tee -a "$OUT/step$step.log" | grep -v "^  (" | tail -60; }
case "$step" in
  1) timeout 540 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_cli.py tests/test_engine.py \
       tests/test_gemm_backends.py tests/test_gluon_gemm.py tests/test_update_kernels.py tests/test_fusion.py \
       tests/test_execution.py tests/test_lora.py tests/test_quant_formats.py tests/test_kernels.py 2>&1 | log ;;
  2) { timeout 260 python3 benchmarks/bench_rollout.py --models 7b --schemes bf16,nvfp4 --batches 64,256 --new 1024 \
         --out "$OUT/r"
       timeout 280 python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --micro 8 --prompt 256 \
         --new 1024 --steps 2 --out "$OUT/g" \
         --variants 'shared:model.share_prompts=true;plain:model.share_prompts=false'; } 2>&1 | log ;;
  3) timeout 560 python3 -m pytest -x -q -rA -s -p no:cacheprovider tests/test_gpu_vllm.py 2>&1 | log ;;
  4) timeout 560 python3 benchmarks/bench_vllm.py --arms vllm-bf16,vllm-nvfp4 --out "$OUT/b" 2>&1 | log ;;
  5) timeout 560 python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --steps 2 --out "$OUT/g" \
       --variants 'engine:;vllm:rollout.backend=vllm;vllm-reload:rollout.backend=vllm,rollout.vllm_lora_update=reload' \
       2>&1 | log ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
