#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-peers/liger_kernel-*.whl .whl-peers/peft-*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
timeout 200 env PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site python3 benchmarks/profile_update.py --scheme nvfp4 --set model.base_gemm=fp8 --top 30 --out $OUT/profile-update 2>&1 | grep -v INFO | tail -32
timeout 360 python3 benchmarks/bench_grpo_step.py --models 7b --schemes nvfp4 --steps 3 --out $OUT \
  --variants "mb8:grpo.micro_batch_size=8;mb8-fp8:grpo.micro_batch_size=8,model.base_gemm=fp8" 2>&1 | grep "^|" | tail -4
