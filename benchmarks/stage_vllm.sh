#!/usr/bin/env bash
# vLLM 0.26.0 (the release built for torch 2.11, the GPU machines' torch) on a GPU machine that has no package index
# and takes at most 64 MiB per call: packed here into parts, carried one part per call, unpacked there. With `peers`,
# the same archive also holds what issue 49's peers need beside vLLM (TRL and Unsloth, benchmarks/bench_peers.py).
#
#   bash benchmarks/stage_vllm.sh pack [peers]   # here (needs pip's index and zstd): writes .vllm/1, .vllm/2, ...
#   # then, on the GPU machine, back to back inside its warm window (a cold machine starts bare):
#   run(carry=[".vllm/1"], command="bash benchmarks/stage_vllm.sh receive")
#   run(carry=[".vllm/2"], command="bash benchmarks/stage_vllm.sh receive && . /tmp/qerl-vllm/env && python3 ...")
#
# `receive` keeps each part in /tmp/qerl-vllm and, once all have come, unpacks them into /tmp/qerl-vllm/site (and
# .../peers, .../unsloth) and writes /tmp/qerl-vllm/env (PYTHONPATH). What is packed: the vllm wheel without what a
# Hopper GPU running dense and NVFP4 (Marlin) Qwen2/Llama models never loads (FlashAttention 2 (Hopper runs FA3), the
# MoE and FlashMLA kernels, DeepGEMM, the SM100 FMHA sources, the Rust frontend, xgrammar's static library), plus the
# Python packages its import and generate paths need that the GPU image lacks (found by importing it; KINDS.md lists
# the image). Not packed: flashinfer (vLLM samples with PyTorch without it), tilelang, cutlass-dsl, humming-kernels
# (vLLM then takes its Marlin FP4 kernels), torchcodec and the serving extras (the OpenAI server is not used here).
#
# `peers` adds two folders. peers/ (on the env's PYTHONPATH after site/): TRL 1.16.0 (the newest; vLLM 0.22-0.31),
# PEFT 0.21.2, datasets 4.8.5 with dill and multiprocess (TRL takes >= 4.7, Unsloth < 5: one version for both arms),
# liger-kernel 0.8.5, bitsandbytes 0.50.2 with only its CUDA 13.0/13.2 and CPU libraries (the image's torch is
# cu130). unsloth/ (PEERS_UNSLOTH_SITE, first on the Unsloth arms' path only): unsloth and unsloth_zoo 2026.10.9
# (without studio/, the web app in unsloth's wheel: 83 MB, imported by neither) and the TRL it pins (<= 1.15.0).
# The image has accelerate, transformers 5.17.0 (Unsloth's ceiling, vLLM 0.26's >= 5.5.3), pyarrow, pandas, fsspec.
#
#   bash benchmarks/stage_vllm.sh archive WORK FOLDER...   # what pack does after downloading: WORK's folders as
#                                                          # the parts in .vllm/ (QERL_VLLM_PART_MB per part)
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE="${QERL_VLLM_STAGE:-/tmp/qerl-vllm}"
PART_MB="${QERL_VLLM_PART_MB:-44}"  # + the repository (~14 MB) and a few MB of wheels: under the 64 MiB a call takes
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform linux_x86_64 --platform any)

unzip_all() {  # unzip_all WHEEL_DIR SITE: every wheel of the folder into one site folder
  mkdir -p "$2"
  for w in "$1"/*.whl; do python3 -m zipfile -e "$w" "$2"; done
}

vllm_site() {  # vllm_site WORK: WORK/site
  local work=$1
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$work/whl" "vllm==0.26.0" "compressed-tensors==0.17.0" \
    "depyf==0.20.0" "xgrammar==0.2.3"  # these three would pull torch; xgrammar 0.2.3 matches tvm-ffi 0.1.10
  python3 -m pip download -q "${PLAT[@]}" -d "$work/whl" blake3 cachetools "fastapi>=0.133,<0.137" \
    "starlette>=1.0.1" "openai>=2.0.0" "pydantic>=2.12" prometheus-fastapi-instrumentator "lm-format-enforcer==0.11.3" \
    "llguidance>=1.7,<1.8" "outlines_core==0.2.14" "lark==1.2.2" partial-json-parser "jsonschema>=4.23" "pyzmq>=25" \
    msgspec python-json-logger pybase64 cbor2 ijson setproctitle "openai-harmony>=0.0.3" "apache-tvm-ffi==0.1.10" \
    "opentelemetry-sdk>=1.27" "opentelemetry-api>=1.27" "opentelemetry-semantic-conventions-ai>=0.4.1" loguru astor \
    dill "numpy<2.6"
  # The image's own copies stay (one version of each): numpy, packaging, pyyaml, idna, h11, attrs, anyio, ...
  (cd "$work/whl" && rm -f numpy-* packaging-* pyyaml-* idna-* h11-* attrs-* prometheus_client-* annotated_doc-* \
    anyio-*)
  unzip_all "$work/whl" "$work/site"
  (cd "$work/site/vllm" && rm -rf vllm_flash_attn/_vllm_fa2_C.abi3.so _moe_C_stable_libtorch.abi3.so vllm-rs \
    _flashmla_C.abi3.so third_party/deep_gemm third_party/fmha_sm100)
  rm -rf "$work"/site/xgrammar/lib/*.a "$work/site/bin"
}

peers_sites() {  # peers_sites WORK: WORK/peers and WORK/unsloth (issue 49's TRL and Unsloth arms)
  local work=$1
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$work/whl-peers" "trl==1.16.0" "peft==0.21.2" \
    "datasets==4.8.5" "dill==0.4.1" "multiprocess==0.70.19" "liger-kernel==0.8.5" "bitsandbytes==0.50.2"
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$work/whl-unsloth" "unsloth==2026.10.9" \
    "unsloth_zoo==2026.10.9" "trl==1.15.0"
  unzip_all "$work/whl-peers" "$work/peers"
  unzip_all "$work/whl-unsloth" "$work/unsloth"
  # bitsandbytes loads libbitsandbytes_cuda{torch.version.cuda}: 13.0 on the image (13.2 beside it), CPU for dry runs
  find "$work/peers/bitsandbytes" -name "libbitsandbytes_*" ! -name "*_cuda130.so" ! -name "*_cuda132.so" \
    ! -name "*_cpu.so" -delete
  rm -rf "$work/unsloth/studio" "$work/peers/bin" "$work/unsloth/bin"
}

archive() {  # archive WORK FOLDER...: WORK's folders as one zstd tarball split into .vllm/1..N, the manifest in 1
  local work=$1; shift
  find "${@/#/$work/}" \( -name "*.cpython-313-*" -o -name "*.cpython-314-*" \) -delete
  rm -rf .vllm && mkdir -p .vllm/1
  tar cf - -C "$work" "$@" | zstd -15 -T0 -q -o "$work/site.tar.zst"
  split -b "${PART_MB}m" -d -a 1 "$work/site.tar.zst" "$work/part."
  local n=0
  for p in "$work"/part.*; do n=$((n + 1)); mkdir -p ".vllm/$n"; mv "$p" ".vllm/$n/"; done
  (cd "$work" && sha256sum site.tar.zst | cut -d' ' -f1) > .vllm/1/manifest
  echo "$n" >> .vllm/1/manifest
  rm -f "$work/site.tar.zst"
  echo "$n"
}

pack() {
  local work; work="$(mktemp -d)"
  local folders=(site)
  vllm_site "$work"
  if [ "${1:-}" = peers ]; then peers_sites "$work"; folders+=(peers unsloth); fi
  local n; n="$(archive "$work" "${folders[@]}")"
  # The decompressor for the machine, with the last (smallest) part: part 1 also carries the manifest.
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d ".vllm/$n" zstandard
  rm -rf "$work"
  du -sh .vllm/* && echo "carry .vllm/1 .. .vllm/$n, one per call"
}

unpack() {  # the archive into $STAGE/unpack: with zstd's own command where there is one, else Python's zstandard
  mkdir -p "$STAGE/unpack"
  if command -v zstd >/dev/null; then
    zstd -dcq "$STAGE/site.tar.zst" | tar xf - -C "$STAGE/unpack"
    return
  fi
  python3 -c "import zstandard" 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --target "$STAGE/zs" "$STAGE"/parts/zstandard-*.whl
  PYTHONPATH="$STAGE/zs${PYTHONPATH:+:$PYTHONPATH}" python3 - "$STAGE" <<'PY'
import sys, tarfile, zstandard
stage = sys.argv[1]
with open(f"{stage}/site.tar.zst", "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
    tarfile.open(fileobj=r, mode="r|").extractall(f"{stage}/unpack", filter="tar")
PY
}

receive() {
  mkdir -p "$STAGE/parts"
  for d in .vllm/*/; do [ -d "$d" ] && cp -f "$d"* "$STAGE/parts/"; done
  [ -f "$STAGE/parts/manifest" ] || { echo "stage_vllm: waiting for part 1 (manifest)"; return 0; }
  local want; want="$(sed -n 2p "$STAGE/parts/manifest")"
  local have; have="$(ls "$STAGE"/parts/part.* 2>/dev/null | wc -l)"
  echo "stage_vllm: $have of $want parts"
  [ "$have" = "$want" ] || return 0
  [ -f "$STAGE/env" ] && { echo "stage_vllm: already unpacked"; return 0; }
  cat "$STAGE"/parts/part.* > "$STAGE/site.tar.zst"
  [ "$(sha256sum "$STAGE/site.tar.zst" | cut -d' ' -f1)" = "$(sed -n 1p "$STAGE/parts/manifest")" ] \
    || { echo "stage_vllm: checksum mismatch"; exit 1; }
  unpack
  rm -f "$STAGE/site.tar.zst"
  local path="$STAGE/site"
  for f in "$STAGE"/unpack/*; do rm -rf "$STAGE/${f##*/}"; mv "$f" "$STAGE/"; done  # site, and peers, unsloth
  rmdir "$STAGE/unpack"
  [ -d "$STAGE/peers" ] && path="$path:$STAGE/peers"
  { echo "export PYTHONPATH=$path\${PYTHONPATH:+:\$PYTHONPATH} VLLM_ENABLE_V1_MULTIPROCESSING=0"
    echo "export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1"
    [ -d "$STAGE/unsloth" ] && echo "export PEERS_UNSLOTH_SITE=$STAGE/unsloth"
    true; } > "$STAGE/env"
  local sizes; sizes="$(cd "$STAGE" && { du -sh site peers unsloth 2>/dev/null || true; } | tr '\t\n' ' ')"
  echo "stage_vllm: unpacked into $STAGE (${sizes% }); . $STAGE/env"
}

case "${1:-}" in
  pack) [ -z "${2:-}" ] || [ "$2" = peers ] \
          || { echo "stage_vllm: pack takes 'peers' or nothing, not '$2'" >&2; exit 2; }
        pack "${2:-}" ;;
  receive) receive ;;
  archive) shift; [ $# -ge 2 ] || { echo "usage: $0 archive WORK FOLDER..." >&2; exit 2; }; archive "$@" >/dev/null
           du -sh .vllm/* ;;
  *) echo "usage: $0 pack [peers] | receive | archive WORK FOLDER..." >&2; exit 2 ;;
esac
