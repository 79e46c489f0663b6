#!/usr/bin/env bash
# Issue 49's GPU run, its second part: the cells 2026-11-28's first four calls left (that chain: this file at
# f2f77c7; its rows in benchmarks/results/2026-11-28-peers/), on one H200, as four device calls back to back that
# stage vLLM and the peers on the way (a machine keeps /tmp only 30 s after a call: nothing to decide between the
# calls, nothing to read until the last has ended):
#
#   run(carry=[".vllm/1"], timeout_s=420, command="bash benchmarks/peers_chain.sh 1")  # ~4 min: qerl, memory first
#   run(carry=[".vllm/2"], timeout_s=300, command="bash benchmarks/peers_chain.sh 2")  # ~1.5 min: the 7B folder
#   run(carry=[".vllm/3"], timeout_s=600, command="bash benchmarks/peers_chain.sh 3")  # ~8 min: unpack; Unsloth 16
#   run(carry=[], timeout_s=600, command="bash benchmarks/peers_chain.sh 4")           # ~9 min: Unsloth 4-bit
#   run(carry=[], timeout_s=600, command="bash benchmarks/peers_chain.sh 5")           # only with >= 10 min left
#
# `.vllm/` comes from `bash benchmarks/stage_vllm.sh pack peers` here (~3 min; 44 + 44 + 25 MiB and the zstandard
# wheel, each part + the ~14 MB repository under a call's 64 MiB). With the machine's start (~40 s) and the gaps,
# ~24 of a session's 30 device minutes by these estimates (the first part's calls took 55-95% of theirs). Each
# call's bench_peers.py run has a budget that ends it inside its timeout with every row written (an arm past it:
# "did not run: ... (killed)" with how far it got; arms after it: "no time left"), so the arms stand in each call
# in the order they matter:
#   1. qerl-nvfp4 at 128 rows again (its update read 12.4 s on 2026-11-28 against 9.9 s in bench_grpo_step's run:
#      each row now records the update's memory plan, recomputed blocks and dequantized weights kept), then
#      qerl-nvfp4-ckpt at 64 and 128 rows: every block recomputed as TRL's gradient checkpointing does, which also
#      keeps no dequantized weights, qerl's peak with memory first for the memory target (vLLM is not needed and
#      not unpacked yet, so Liger is not on the path: `training_kernels: auto` takes `compile`, at par with it).
#   2. the random 7B as a Hugging Face folder (15 GB into PEERS_MODEL_DIR), loaded by every peer arm after it.
#   3. unsloth-vllm-16bit at 64 and 128 rows (the fastest peer), 4. unsloth-vllm-4bit at 64 and 128 rows. Both
#      again at 64: the first part's Unsloth rows ran with `mask_truncated_completions` on, which Unsloth sets for
#      loss_type dapo when it is left unset (the harness now says False, as qerl's and TRL's arms run): every
#      completion here is truncated, so their loss was zero (their gradient too) and each completion was out of
#      the update's attention mask, which may have changed its work.
#   5. trl-vllm-qlora at 128 rows (the slowest peer: it does not move a target), only with >= 10 minutes left.
# Outputs: $OUT/peers/peers.jsonl (one row per arm and row count, each with the package versions it ran),
# $OUT/stepN.log (the whole output); the table of all the calls, both parts: bench_peers.py --table
# DIR*/peers/peers.jsonl.
# A dry run of the plumbing on the CPU (the arms at tiny size, vLLM's arms then saying why they did not run):
#   PATH=$PWD/.venv/bin:$PATH OUT=DIR QERL_VLLM_STAGE=DIR PEERS_DEVICE=cpu PEERS_SIZE=--tiny \
#     bash benchmarks/peers_chain.sh N
set -uo pipefail
cd "$(dirname "$0")/.."
step="${1:?usage: peers_chain.sh 1|2|3|4|5}"
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
  1) peers 330 qerl-nvfp4@128,qerl-nvfp4-ckpt@64,qerl-nvfp4-ckpt@128 ;;
  2) timeout 200 python3 benchmarks/bench_peers.py --device "$device" $size --save-model 2>&1 | log ;;
  3) [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (were calls 1-2 back to back?)"; exit 1; }
     peers 500 unsloth-vllm-16bit@64,unsloth-vllm-16bit@128 ;;
  4) [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (a cold machine?)"; exit 1; }
     peers 540 unsloth-vllm-4bit@64,unsloth-vllm-4bit@128 ;;
  5) [ -f "$stage/env" ] || { echo "peers_chain: vLLM is not unpacked (a cold machine?)"; exit 1; }
     peers 540 trl-vllm-qlora@128 ;;
  *) echo "peers_chain: unknown step $step (1-5)" >&2; exit 2 ;;
esac
