#!/usr/bin/env bash
# The update's speed paths, measured in one call on one GPU (issue #28): the code before them (.base: `git archive`
# of the previous commit, carried) against every setting of model.gradient_checkpointing x model.training_kernels,
# 7B NVFP4 (gluon layout: no humming-kernels JIT in every arm's process), each arm in its own process.
#   bash benchmarks/run_update_arms.sh OUTDIR
set -uo pipefail
out=${1:-outputs/update-arms}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -d .base ]; then
  (cd .base && PYTHONPATH=.:${PYTHONPATH:-} timeout 300 python3 benchmarks/bench_grpo_step.py --models 7b \
     --schemes nvfp4 --out "$OLDPWD/$out/base" 2>&1 | grep -v " INFO " | tail -4)
fi
PYTHONPATH=.:${PYTHONPATH:-} timeout 420 python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 \
  --out "$out" --variants "${VARIANTS:-ckpt-eager:model.gradient_checkpointing=true,model.training_kernels=eager;auto-eager:model.training_kernels=eager;auto-compile:model.training_kernels=compile;auto-liger:model.training_kernels=liger}" \
  2>&1 | grep -v " INFO "
