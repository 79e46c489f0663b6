#!/usr/bin/env bash
# The "does AQN help?" seeds experiment on one GPU machine (issue #32), in two device calls on the same warm machine
# (the embedded model's 98 MB GGUF cannot travel in one 64-MiB call: benchmarks/smollm2_parts.py):
#
#   here, once:  pip download --no-deps --only-binary=:all: gguf==0.19.0 -d .whl-extra
#                python benchmarks/smollm2_parts.py split          # .carry-a (50 MiB), .carry-b (52 MiB)
#   call 1:      bash benchmarks/run_aqn_seeds.sh stage            carry [".carry-a"]          (seconds)
#   call 2:      bash benchmarks/run_aqn_seeds.sh                  carry [".carry-b"]  within 30 s of call 1
#
# Call 2 installs the carried wheels, assembles the model (SHA-256 checked against the CPU's conversion), runs
# benchmarks/aqn_seeds.py (5 arms x SEEDS seeds x 2 tasks, JOBS workers sharing the GPU) until BUDGET seconds after
# its start, then packs every run's raw results into $OUT/aqn-seeds.tar.gz and runs the analysis (if matplotlib is
# there). Runs left undone are listed in status.json; a later pair of calls with the returned aqn-seeds.tar.gz copied
# to .carry-b/ trains only those. Knobs (environment): SEEDS=20 STEPS=24 JOBS=14 BUDGET=520 WORKER_GIB=4.5, and EXTRA_ARGS (more
# driver arguments, e.g. "--arms bf16-lora nvfp4 -S eval.n=4" for a CPU rehearsal).
set -uo pipefail
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false QERL_CACHE=${QERL_CACHE:-/tmp/qerl-cache}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# The NVFP4 GEMM backends come from the shape-generic defaults, not measured: aqn_seeds.py's RUN_OVERRIDES say why.
OUT=${OUT:-/tmp/aqn-out}; mkdir -p "$OUT"
if [ "${1:-}" = stage ]; then
  exec python3 benchmarks/smollm2_parts.py stage
fi
SEEDS=${SEEDS:-20} STEPS=${STEPS:-24} JOBS=${JOBS:-14} BUDGET=${BUDGET:-520} WORKER_GIB=${WORKER_GIB:-4.5}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${SITE:=/tmp/site}" \
  .carry-b/wheels/*.whl || exit 4
export PYTHONPATH=$PWD:$SITE
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers, bitsandbytes; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'bitsandbytes', bitsandbytes.__version__, 'cuda', torch.cuda.is_available())"
python3 benchmarks/smollm2_parts.py assemble --cache "$QERL_CACHE" || exit 3
RES=${RES:-/tmp/aqn-seeds}
if [ -f .carry-b/aqn-seeds.tar.gz ]; then  # a previous call's results: only the missing runs train
  mkdir -p "$RES" && tar -xzf .carry-b/aqn-seeds.tar.gz -C "$RES" && echo "resuming from .carry-b/aqn-seeds.tar.gz"
fi
echo "set-up took $(( $(date +%s) - START )) s"
python3 benchmarks/aqn_seeds.py --out "$RES" --seeds "$SEEDS" --jobs "$JOBS" --per-gpu auto \
  --worker-gib "$WORKER_GIB" --deadline $(( START + BUDGET )) --first-estimate-s 60 \
  -S train.steps="$STEPS" -S grpo.micro_batch_size=64 ${EXTRA_ARGS:-} 2>&1 | tee "$OUT/driver.log" | grep -v "^\[worker"
echo "finished runs: $(ls "$RES"/*/*/seed-*/result.json 2>/dev/null | wc -l); packing"
# Raw results only: metrics, params, evaluation metrics, results, errors, status (no checkpoints, no lock files);
# the evaluations' samples apart (~6 MB packed), so that aqn-seeds.tar.gz (~2 MB) fits beside .carry-b in a resume.
(cd "$RES" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.yaml' \) ! -name '.*' \
  ! -name samples.jsonl -print0 | tar --null -czf "$OUT/aqn-seeds.tar.gz" -T -)
(cd "$RES" && find . -type f -name samples.jsonl -print0 | tar --null -czf "$OUT/aqn-samples.tar.gz" -T -)
# At most 8 files come back from $OUT: driver.log, the two tarballs, the report (report.md + report.tar.gz).
if python3 -c "import matplotlib" 2>/dev/null && [ $(( $(date +%s) - START )) -lt 565 ]; then
  timeout $(( 585 - ($(date +%s) - START) )) python3 benchmarks/analyze_aqn_seeds.py --results "$RES" \
    --report /tmp/aqn-report --bootstrap 2000 > /tmp/aqn-report.log 2>&1 \
    && cp /tmp/aqn-report/report.md "$OUT/report.md" && tar -czf "$OUT/report.tar.gz" -C /tmp aqn-report \
    || tail -5 /tmp/aqn-report.log
fi
ls -la "$OUT"; cat "$RES/status.json" 2>/dev/null | python3 -c "import json,sys; s=json.load(sys.stdin); \
print({k: (len(v) if isinstance(v, list) else v) for k, v in s.items() if k not in ('command', 'arms')})"
echo "total $(( $(date +%s) - START )) s"
