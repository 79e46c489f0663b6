#!/usr/bin/env bash
# Rollouts and GRPO steps at the lengths RL produces (benchmarks/lengths.py), on one H200 at 7B shapes: 128 rows
# (16 prompts x 8) of 256-token prompts, each row ending at its traced length. Three device calls, back to back on
# one warm machine (nothing carried, nothing downloaded; each call stands alone):
#
#   run(carry=[], timeout_s=600, command="bash benchmarks/ragged_chain.sh 1")  # ~320 s: gsm8k rollouts; 2 steps
#   run(carry=[], timeout_s=600, command="bash benchmarks/ragged_chain.sh 2")  # ~190 s: 2 more steps on gsm8k
#   run(carry=[], timeout_s=600, command="bash benchmarks/ragged_chain.sh 3")  # ~360 s: long-cot rollouts
# and issue #60's second round (2026-12-02, second session), the vLLM parts carried one per call (stage_vllm.sh):
#   run(carry=[".vllm/1"], command="bash benchmarks/ragged_chain.sh 4")  # ~280 s: gsm8k steps: plain, spec, over
#   run(carry=[".vllm/2"], command="bash benchmarks/ragged_chain.sh 5")  # ~400 s: long-cot steps at 64 rows
#   run(carry=[".vllm/3"], command="bash benchmarks/ragged_chain.sh 6")  # ~370 s: vLLM NVFP4 vs ours on both traces
#
# 4. bench_grpo_step on gsm8k at 128 rows: NVFP4 plain, + rollout.speculative=on (from 8 live rows, the oracle's
#    drafts at 0.7), + rollout.overprovision=0.25 (20 prompts drawn, the first 16 groups to finish trained).
# 5. bench_grpo_step on long-cot at 64 rows (8 prompts; the update pads to 4,096 unless packed): NVFP4 and bf16,
#    each plain and packed.
# 6. bench_vllm on both traces at 128 rows: vLLM 0.26 NVFP4 (dummy weights: speed does not depend on them) against
#    our NVFP4 engine, each in its own process, the identical call untimed first.
#
# 1. bench_rollout on the gsm8k trace (cap 1,024; median 237 tokens; 1 row truncated; 44% of its decode steps
#    below 8 live rows): bf16 and NVFP4 plain, NVFP4 speculative at acceptance 0.5 / 0.7 / 0.9 from 8 and from 16
#    live rows (the oracle policy and drafts; every arm runs the same policy), each timed call after an identical
#    untimed one (`--warmup every`: the engine's cost-aware query sizes reach verify graphs a first warm-up may not
#    have). Then bench_grpo_step on gsm8k at acceptance 0.7: NVFP4 plain, NVFP4 + model.pack_completions (the
#    padding-free update; the batch is otherwise padded to its longest completion, 1,024 here).
# 2. bench_grpo_step on gsm8k: NVFP4 + rollout.speculative=on from 8 rows (the oracle's drafts at 0.7), bf16 plain.
#    On 2026-12-02 this speculative arm (from 32 rows) read acceptance 0.00 on the H200 and 0.38-0.60 on the CPU;
#    its rows now say where that comes from: oracle_drafted (the tokens the oracle proposed: 0 means its drafts never
#    reached the engine), oracle_acceptance_observed (the oracle's share of the tokens emitted where it had drafted:
#    ~0.7 when the policy is the oracle's), oracle_nonfinite_draws (draws whose logits had no finite value: a verify
#    forward that returned NaN or -inf, where the oracle's probability is not A).
# 3. bench_rollout on the long-cot trace (cap 4,096; median ~1,850; 12 of 128 rows truncated, so never fewer than 12
#    live rows before the cap: 0% of decode steps below 8 live rows, 17% below 16): bf16 and NVFP4 plain, NVFP4
#    speculative from 16 rows at 0.5 / 0.7 / 0.9 (from 8 rows it would never engage on this trace).
#
# Estimates, from BENCHMARKS.md's figures (a 7B NVFP4 rollout of 128 x 1,024 fixed tokens in ~9.4 s; a decode step
# of ~3.4 ms at <= 8 rows, ~5.7 ms at 64, ~7.8 ms at 128 plus attention over the KV window reproduces it; ~0.5 s a
# captured graph; 77-107 s per GRPO arm process to two fixed-length steps) and 2026-12-02's ragged readings (gsm8k,
# 128 rows: 5,100-5,700 useful tok/s NVFP4, i.e. ~6.5 s a rollout, bf16 ~7.5 s; long-cot bf16 7,047 tok/s, ~38.5 s;
# a GRPO step on gsm8k 15-17 s, its first 30-50 s):
#   - call 1: rollouts ~140 s (bf16 2 x 7.5 s, NVFP4 plain 2 x 6.5, 6 speculative arms 2 x ~5.5 each, ~40 s of
#     capture, builds and imports), 2 GRPO arms ~180 s.
#   - call 2: 2 GRPO arms ~190 s (the bf16 arm the slower).
#   - call 3: ~360 s: bf16 2 x 38.5 s, NVFP4 plain 2 x ~35 s, speculative from 16 rows 4 x ~33 s (the first warmed
#     up), ~50 s of capture (decode graphs for 5 buckets x 17 windows at most, verify graphs), builds and imports.
# Every command has a budget that ends it inside the call with its rows written (bench_rollout skips a config that
# the trace's last timing says would not fit; bench_grpo_step skips an arm the slowest arm so far says would not
# fit, and stops one at the budget), and a `timeout` behind it.
# Outputs: $OUT/rollout.jsonl (bench_rollout rows, one per arm: useful_tokens_per_s, decode_step_share_below8,
# wall_share_below8, accepted / drafted, oracle_acceptance_observed, captures_timed, lengths_exact, ...),
# $OUT/grpo_step.jsonl (bench_grpo_step rows: step_s, rollout_s, update_s, update_tokens, lengths_exact,
# speculative/*, oracle_*), $OUT/callN.log (the whole output, the tables at its end).
# A dry run on the CPU (tiny shapes, 16 rows, the traces scaled to a cap of 256, short prompts):
#   PATH=$PWD/.venv/bin:$PATH OUT=DIR RAGGED_DEVICE=cpu RAGGED_MODEL=tiny RAGGED_PROMPTS=2 RAGGED_NEW=256 \
#     RAGGED_PROMPT=16 bash benchmarks/ragged_chain.sh N
set -uo pipefail
cd "$(dirname "$0")/.."
call="${1:?usage: ragged_chain.sh 1|2|3}"
device="${RAGGED_DEVICE:-cuda}" model="${RAGGED_MODEL:-7b}" prompts="${RAGGED_PROMPTS:-16}"
prompt="${RAGGED_PROMPT:-256}" new="${RAGGED_NEW:+--new $RAGGED_NEW}"
rows=$((prompts * 8))
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $((${1} - ($(date +%s) - start))); }  # left END_S: seconds from now to END_S into the call
log() { tee -a "$OUT/call$call.log" | grep -v -E " INFO |it/s\]|s/it\]" | tail -60; }
rollout() {  # rollout END_S TRACE ARGS...: bench_rollout's ragged arms on TRACE, done by END_S into the call
  local end=$1 trace=$2; shift 2
  timeout $(($(left "$end") + 20)) python3 benchmarks/bench_rollout.py --device "$device" --models "$model" \
    --schemes bf16,nvfp4 --batches "$rows" --prompt "$prompt" $new --lengths "$trace" --speculative off,on \
    --speculative-schemes nvfp4 --budget "$(left "$end")" --out "$OUT" "$@" 2>&1 | log
}
steps() {  # steps END_S SCHEMES VARIANTS [TRACE [PROMPTS]]: bench_grpo_step's arms at acceptance 0.7, by END_S
  timeout $(($(left "$1") + 20)) python3 benchmarks/bench_grpo_step.py --device "$device" --models "$model" \
    --schemes "$2" --variants "$3" --prompts "${5:-$prompts}" --prompt "$prompt" $new --lengths "${4:-gsm8k}" \
    --acceptance 0.7 \
    --budget "$(left "$1")" --out "$OUT" 2>&1 | log
}
[ "$device" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee -a "$OUT/call$call.log"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/call$call.log"
# calls 4-6 each bring one part of vLLM (stage_vllm.sh): kept in /tmp/qerl-vllm while the machine stays warm
case "$call" in 4|5|6) bash benchmarks/stage_vllm.sh receive | tee -a "$OUT/call$call.log" ;; esac
case "$call" in
  1) rollout 220 gsm8k --acceptance 0.5,0.7,0.9 --speculative-rows 8,16 --warmup every
     steps 550 nvfp4 'plain:;packed:model.pack_completions=true' ;;
  2) steps 550 nvfp4 'spec:rollout.speculative=on'
     steps 550 bf16 'plain:' ;;
  3) rollout 550 long-cot --acceptance 0.5,0.7,0.9 --speculative-rows 16 ;;
  4) steps 560 nvfp4 'plain:;spec:rollout.speculative=on;over:rollout.overprovision=0.25' ;;
  5) steps 560 nvfp4,bf16 'plain:;packed:model.pack_completions=true' long-cot $((prompts / 2)) ;;
  6) if [ -f /tmp/qerl-vllm/env ]; then
       . /tmp/qerl-vllm/env
       timeout $(($(left 570))) python3 benchmarks/bench_vllm.py --model "$model" --rows "$rows" --prompt "$prompt" \
         --lengths gsm8k,long-cot --arms vllm-nvfp4,qerl-nvfp4 --weights dummy --folder /tmp/qerl-vllm-bench \
         --out "$OUT" 2>&1 | log
     fi ;;
  *) echo "ragged_chain: unknown call $call (1-6)" >&2; exit 2 ;;
esac
echo "ragged_chain $call: done in $(($(date +%s) - start)) s" | tee -a "$OUT/call$call.log"
