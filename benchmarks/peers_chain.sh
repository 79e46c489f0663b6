#!/usr/bin/env bash
# Issue 49's GPU run: qerl beside TRL with vLLM colocated and Unsloth with its vLLM fast inference, on one H200, as
# four device calls back to back that stage vLLM and the peers on the way (a machine keeps /tmp only 30 s after a
# call: nothing to decide between the calls, nothing to read until the last has ended):
#
#   run(carry=[".vllm/1"], timeout_s=420, command="bash benchmarks/peers_chain.sh 1")  # ~4 min: qerl, 64 + 128 rows
#   run(carry=[".vllm/2"], timeout_s=420, command="bash benchmarks/peers_chain.sh 2")  # ~3.5 min: #46, the 7B folder
#   run(carry=[".vllm/3"], timeout_s=600, command="bash benchmarks/peers_chain.sh 3")  # ~9.5 min: unpack; TRL + vLLM
#   run(carry=[], timeout_s=600, command="bash benchmarks/peers_chain.sh 4")           # ~8.5 min: Unsloth + vLLM
#   run(carry=[], timeout_s=600, command="bash benchmarks/peers_chain.sh 5")           # only with >= 10 min left
#   run(carry=[], timeout_s=420, command="bash benchmarks/peers_chain.sh 6")           # #46, with >= 7.5 min left
#
# `.vllm/` comes from `bash benchmarks/stage_vllm.sh pack peers` here (~3 min; 44 + 44 + 25 MiB and the zstandard
# wheel, each part + the ~14 MB repository under a call's 64 MiB). With the machine's start (~2 min) and the gaps,
# ~29 of a session's 30 device minutes by these estimates. They are upper bounds: gpu_chain.sh's calls took 30-75%
# of theirs on 2026-11-28 and a start ~40 s. Each call's bench_peers.py run has a budget that ends it inside its
# timeout with every row written (an arm past it: "did not run: ... (killed)" with how far it got; arms after it:
# "no time left"), so the arms stand in each call in the order they matter:
#   1. qerl-nvfp4 at 64 and 128 rows (qerl's baseline; vLLM is not needed and not unpacked yet, so Liger is not on the
#      path either: `training_kernels: auto` takes `compile`, measured at par with Liger: 6.3 vs 6.4 s).
#   2. issue 46's owed one-row anchor: qerl's 7B arms at 1 and 8 rows, now timed after a warm-up as vLLM's arms
#      are (bench_vllm.py; its vLLM side at those rows is 2026-11-28's); then the random 7B as a Hugging Face
#      folder (15 GB into PEERS_MODEL_DIR), loaded by every vLLM arm after it.
#   3. trl-vllm at 64 and 128 rows (~3.5-4 min each: imports, the model, vLLM's start with its compile and graph
#      capture (~100 s; the second process reads the compile cache), two steps), then trl-vllm-qlora at 64.
#   4. unsloth-vllm-4bit and unsloth-vllm-16bit at 64 rows (~4 min each), then unsloth-vllm-4bit at 128.
#   The last arm of calls 3 and 4 is expected to be cut by the budget (its row says how far it got). Call 5 runs
#   them, and Unsloth 16-bit at 128 rows, if the session's status still shows 10 device minutes after call 4 (a
#   machine of one chip is at times counted at part of its held time): the one choice in the chain, made on the
#   status alone, not on any output.
#   6. issue 46's rest, only with >= 7.5 device minutes left: qerl's 32B arms at 1 and 8 rows, then the vLLM
#      backend's 7B step (bench_grpo_step.py, a new LoRA id; it writes the base folder vLLM loads). Its device
#      peak (NVML) should now be near the trainer's ~66 GiB: it was 104 while vLLM woke beside the update's cache.
# Outputs: $OUT/peers/peers.jsonl (one row per arm and row count, each with the package versions it ran),
# $OUT/stepN.log (the whole output); the table of all four calls: bench_peers.py --table DIR*/peers/peers.jsonl.
# A dry run of the plumbing on the CPU (the arms at tiny size, vLLM's arms then saying why they did not run):
#   OUT=DIR QERL_VLLM_STAGE=DIR PEERS_DEVICE=cpu PEERS_SIZE=--tiny bash benchmarks/peers_chain.sh N
set -uo pipefail
cd "$(dirname "$0")/.."
step="${1:?usage: peers_chain.sh 1|2|3|4|5|6}"
stage="${QERL_VLLM_STAGE:-/tmp/qerl-vllm}" device="${PEERS_DEVICE:-cuda}" size="${PEERS_SIZE:---model 7b}"
bash benchmarks/stage_vllm.sh receive
# Nothing reaches the network (the machine has none); the model folder outlives the call while the machine is warm.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false UNSLOTH_DISABLE_STATISTICS=1 PEERS_MODEL_DIR=/tmp/peers-models
[ -f "$stage/env" ] && . "$stage/env" && export PYTHONPATH=$PWD:$PYTHONPATH
log() { tee -a "$OUT/step$step.log" | grep -v -E " INFO |it/s\]|s/it\]|Warning|warn\(" | tail -80; }
peers() {  # peers BUDGET_S ARMS: one bench_peers.py run, its rows appended to $OUT/peers/peers.jsonl
  timeout $(($1 + 30)) python3 benchmarks/bench_peers.py --device "$device" $size --steps 2 --budget-s "$1" \
    --arm-timeout 330 --vllm-memory 0.3 --arms "$2" --out "$OUT/peers" 2>&1 | log
}
[ "$device" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee -a "$OUT/step$step.log"
case "$step" in
  1) peers 330 qerl-nvfp4@64,qerl-nvfp4@128 ;;
  2) [ "$device" = cpu ] || timeout 170 python3 benchmarks/bench_vllm.py --out "$OUT/anchor" --rows 1,8 --long "" \
       --arms qerl-nvfp4,qerl-bf16 2>&1 | log
     timeout 200 python3 benchmarks/bench_peers.py --device "$device" $size --save-model 2>&1 | log ;;
  3) [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (were calls 1-2 back to back?)"; exit 1; }
     peers 500 trl-vllm@64,trl-vllm@128,trl-vllm-qlora@64 ;;
  4) [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (a cold machine?)"; exit 1; }
     peers 480 unsloth-vllm-4bit@64,unsloth-vllm-16bit@64,unsloth-vllm-4bit@128 ;;
  5) [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (a cold machine?)"; exit 1; }
     peers 540 trl-vllm-qlora@64,unsloth-vllm-16bit@128,unsloth-vllm-4bit@128 ;;
  6) [ "$device" = cpu ] && { echo "peers_chain: call 6 measures GPU figures only (nothing to dry-run)"; exit 0; }
     [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (a cold machine?)"; exit 1; }
     timeout 150 python3 benchmarks/bench_vllm.py --out "$OUT/anchor" --model 32b --rows 1,8 --long "" \
       --weights dummy --arms qerl-nvfp4,qerl-bf16 2>&1 | log
     timeout 240 python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --micro 8 --steps 2 \
       --out "$OUT/step" --variants 'vllm:rollout.backend=vllm' 2>&1 | log ;;
  *) echo "peers_chain: unknown step $step (1-6)" >&2; exit 2 ;;
esac
