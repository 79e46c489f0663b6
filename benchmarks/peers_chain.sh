#!/usr/bin/env bash
# Issue 49's GPU run, its second part, as it ran on 2026-11-28 (seventh session; rows in
# docs/results/2026-11-28-peers2/, the first part's chain is this file at f2f77c7): the cells the first part
# left, on one H200, as device calls back to back that stage vLLM and the peers on the way (a machine keeps /tmp only
# 30 s after a call: nothing to read between the calls but whether the last cell fitted):
#
#   run(carry=[".vllm/1"], timeout_s=420, command="bash benchmarks/peers_chain.sh 1")  # 266 s: qerl, memory first
#   run(carry=[".vllm/2"], timeout_s=300, command="bash benchmarks/peers_chain.sh 2")  #  39 s: the 7B folder
#   run(carry=[".vllm/3"], timeout_s=600, command="bash benchmarks/peers_chain.sh 3")  # 500 s: unpack; Unsloth 16
#   run(carry=[], timeout_s=600, command="bash benchmarks/peers_chain.sh 4")           # 433 s: Unsloth 16 / 4-bit
#   run(carry=[], timeout_s=430, command="bash benchmarks/peers_chain.sh 5")           # 210 s: Unsloth 4-bit
#   run(carry=[], timeout_s=600, command="bash benchmarks/peers_chain.sh 6")           # not run: device time out
#
# `.vllm/` comes from `bash benchmarks/stage_vllm.sh pack peers` here (~3 min; 44 + 44 + 25 MiB and the zstandard
# wheel, each part + the ~14 MB repository under a call's 64 MiB). With the machine's start (~40 s) and the gaps,
# 25 of a session's 30 device minutes. Each call's bench_peers.py run has a budget that ends it inside its timeout
# with every row written (an arm past it: "did not run: ... (killed)" with how far it got; arms after it: "no time
# left"), so the arms stand in each call in the order they matter:
#   1. qerl-nvfp4 at 128 rows again (its update read 12.4 s in the first part against 9.9 s in bench_grpo_step's
#      run: each row now records the update's memory plan, recomputed blocks and dequantized weights kept), then
#      qerl-nvfp4-ckpt at 64 and 128 rows: every block recomputed as TRL's gradient checkpointing does, which also
#      keeps no dequantized weights, qerl's peak with memory first for the memory target (vLLM is not needed and
#      not unpacked yet, so Liger is not on the path: `training_kernels: auto` takes `compile`, at par with it).
#   2. the random 7B as a Hugging Face folder (15 GB into PEERS_MODEL_DIR), loaded by every peer arm after it.
#   3-5. Unsloth 16-bit (the fastest peer) and 4-bit at 64 and 128 rows, each first at 64 again: the first part's
#      Unsloth rows ran with `mask_truncated_completions` on, which Unsloth sets for loss_type dapo when it is left
#      unset (the harness now says False, as qerl's and TRL's arms run): every completion here is truncated, so
#      their loss was zero (their gradient too). Call 3's 16-bit at 128 did not fit its budget (a 65 s first step
#      after an 83 s load), so call 4 ran it first and call 5 took the last cell.
#   6. trl-vllm-qlora at 128 rows (the slowest peer: 4.19x behind qerl at 64 rows, it moves no target), owed.
# Outputs: $OUT/peers/peers.jsonl (one row per arm and row count, each with the package versions it ran),
# $OUT/stepN.log (the whole output); the table of all the calls, both parts: bench_peers.py --table
# DIR*/peers/peers.jsonl.
# A dry run of the plumbing on the CPU (the arms at tiny size, vLLM's arms then saying why they did not run):
#   PATH=$PWD/.venv/bin:$PATH OUT=DIR QERL_VLLM_STAGE=DIR PEERS_DEVICE=cpu PEERS_SIZE=--tiny \
#     bash benchmarks/peers_chain.sh N
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
vllm_peers() {  # vllm_peers BUDGET_S ARMS: peers, once calls 1-3 have unpacked vLLM on this (still warm) machine
  [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (calls 1-3 back to back? a cold machine?)"; exit 1; }
  peers "$@"
}
[ "$device" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee -a "$OUT/step$step.log"
case "$step" in
  1) peers 330 qerl-nvfp4@128,qerl-nvfp4-ckpt@64,qerl-nvfp4-ckpt@128 ;;
  2) timeout 200 python3 benchmarks/bench_peers.py --device "$device" $size --save-model 2>&1 | log ;;
  3) vllm_peers 500 unsloth-vllm-16bit@64,unsloth-vllm-16bit@128 ;;
  4) vllm_peers 540 unsloth-vllm-16bit@128,unsloth-vllm-4bit@64 ;;
  5) vllm_peers 370 unsloth-vllm-4bit@128 ;;
  6) vllm_peers 540 trl-vllm-qlora@128 ;;
  *) echo "peers_chain: unknown step $step (1-6)" >&2; exit 2 ;;
esac
