#!/usr/bin/env bash
# qerl beside TRL (+ PEFT, bf16 and QLoRA) and Unsloth on one GPU, in one device call (issue #31).
#   bash benchmarks/run_peers.sh OUTDIR [ARMS]        # the device call carries [".whl-peers"]
# ARMS (comma-separated; default: the first call's) among qerl-nvfp4, qerl-nvfp4-ckpt, qerl-bf16, qerl-nf4-bnb, trl,
# trl-qlora, unsloth. Three calls of ≤ 9 minutes hold every arm, each with the NVFP4 arm as its in-call baseline:
#   call 1: qerl-nvfp4,qerl-nvfp4-ckpt,qerl-bf16,trl      call 2: qerl-nvfp4,qerl-nf4-bnb,trl-qlora
#   call 3: ARM_TIMEOUT=420 ... qerl-nvfp4,unsloth
# Every arm runs in its own process (bench_peers.py) with a time limit inside BUDGET_S (default 530 s) for the
# whole run, so the call ends inside its 600 s with every row written: OUTDIR/peers.jsonl, OUTDIR/peers.log (the
# whole output), OUTDIR/versions.txt. An arm that cannot run is a row "did not run: <exactly why>".
#
# .whl-peers/ (git-ignored, built on the development machine; see BENCHMARKS.md "Beside TRL and Unsloth"):
#   trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19 (cp312), peft 0.21.2, liger-kernel 0.8.5,
#   bitsandbytes 0.50.2 (its CUDA 13.0/13.2 and CPU libraries only: the image's torch is cu130);
#   unsloth/: unsloth 2026.10.9 (without its studio/ web app), unsloth_zoo 2026.10.9, and the TRL and datasets it
#   pins (trl 1.15.0, datasets 4.8.5), first on the PYTHONPATH of the unsloth arm only.
# A dry run of this script on the CPU (arms at tiny size; WHL: the wheels for this machine's Python):
#   DEVICE=cpu EXTRA=--tiny WHL=DIR bash benchmarks/run_peers.sh OUTDIR all
set -uo pipefail
out=${1:-outputs/peers}; arms=${2:-${ARMS:-qerl-nvfp4,qerl-nvfp4-ckpt,qerl-bf16,trl}}
whl=${WHL:-.whl-peers}; device=${DEVICE:-cuda}
mkdir -p "$out"
# Nothing reaches the network (the machine has none). The NVFP4 arm takes Hopper's default Gluon layout (no
# humming-kernels JIT in its process).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false UNSLOTH_DISABLE_STATISTICS=1 PEERS_MODEL_DIR=${PEERS_MODEL_DIR:-/tmp/peers-models}
site=/tmp/site-peers
pip_in() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pip_in "$site" "$whl"/*.whl || { echo "installing $whl failed: was it carried?"; exit 1; }
if ls "$whl"/unsloth/*.whl >/dev/null 2>&1; then
  pip_in /tmp/site-unsloth "$whl"/unsloth/*.whl && export PEERS_UNSLOTH_SITE=/tmp/site-unsloth
fi
export PYTHONPATH=$PWD:$site
# datasets 5.2 wants pyarrow >= 24: on an image with an older one, fall back to 4.8.5 (TRL 1.16 takes >= 4.7).
if ! python3 -c "import datasets, trl.trainer.grpo_trainer" 2>"$out/import-error.txt"; then
  echo "datasets 5.2 / TRL do not import here ($(tail -1 "$out/import-error.txt")): datasets 4.8.5 instead"
  pip_in "$site" "$whl"/unsloth/datasets-*.whl
fi
{
  [ "$device" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'E'
import importlib.metadata as md


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


names = ("torch transformers accelerate peft trl datasets bitsandbytes liger-kernel triton pyarrow fsspec pandas "
         "huggingface-hub tokenizers safetensors numpy").split()
print("packages:", ", ".join(f"{n} {version(n)}" for n in names))
E
  [ -z "${PEERS_UNSLOTH_SITE:-}" ] || PYTHONPATH=$PEERS_UNSLOTH_SITE:$PYTHONPATH python3 -c "
import importlib.metadata as md; print('unsloth arm:', ', '.join(f'{n} {md.version(n)}' for n in ('unsloth', 'unsloth_zoo', 'trl', 'datasets')))"
} 2>&1 | tee "$out/versions.txt"
python3 benchmarks/bench_peers.py --device "$device" ${EXTRA:---model 7b} --arms "$arms" --steps 2 \
  --arm-steps trl=1,trl-qlora=1,unsloth=1 --arm-timeout "${ARM_TIMEOUT:-300}" --budget-s "${BUDGET_S:-530}" \
  --out "$out" 2>&1 | tee "$out/peers.log" | grep -v -E " INFO |it/s\]|s/it\]|Warning|warn\(" 
