#!/usr/bin/env bash
# The forked SGLang on the GPU machine, from the parts benchmarks/sglang_bundle.py makes here.
#
#   bash benchmarks/sglang_device.sh unpack .sgdev/0.5.23/part-1.tar   # one part per call,
#   bash benchmarks/sglang_device.sh unpack .sgdev/0.5.23/part-2.tar   # calls back to back
#   bash benchmarks/sglang_device.sh run python3 -m sglang.launch_server --model-path \
#       /tmp/sgdev/models/qwen3-0.6b --load-format dummy --attention-backend triton \
#       --sampling-backend pytorch --kvcore-elastic ...
#
# unpack: installs a part under $SGDEV (default /tmp/sgdev, kept while the machine stays
# warm): dependency wheels, the SGLang tree and sgl_kernel's Python files into $SGDEV/site,
# the offline model directories into $SGDEV/models. A file the bundle split into pieces
# (NAME.K-of-N, in different parts) is joined once its last piece is unpacked. run: the
# command with that site, sgl_kernel's stand-in ops (benchmarks/sglang_compat/standin: its
# binary cannot run on the image's torch) and this checkout (kvcore, benchmarks) on
# PYTHONPATH, the hub offline, KVCORE_MODEL_DIR set to the Qwen3-0.6B-shaped model.
# `status` says which parts are in. `pack [DIR]`, last in a call: DIR's (default $OUT's)
# files into one results.tar (the device tool brings back at most 8 files).
set -euo pipefail
SGDEV=${SGDEV:-/tmp/sgdev}
repo=$(cd "$(dirname "$0")/.." && pwd)

DEV=$SGDEV
# shellcheck source=benchmarks/device_parts.sh
source "$repo/benchmarks/device_parts.sh"

member() {  # install one bundle member (a file under $tmp)
  local f=$1
  case "$f" in
    */wheels.tar | */wheels.tar.xz | */models.tar.xz) shared_member "$f" ;;
    */sglang-py.tar.xz | */sgl_kernel-py.tar.xz) tar -xJf "$f" -C "$SGDEV/site" ;;
    *) echo "sglang_device.sh: unknown bundle member $f" >&2; exit 2 ;;
  esac
}

case "${1:-}" in
  unpack) shift; for p in "$@"; do unpack "$p"; done ;;
  status) status ;;
  pack) pack "${2:-${OUT:?pack needs a folder or \$OUT}}" ;;
  run)
    shift
    standin="$repo/benchmarks/sglang_compat/standin"
    export PYTHONPATH="$SGDEV/site:$standin:$repo${PYTHONPATH:+:$PYTHONPATH}"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 DO_NOT_TRACK=1
    export KVCORE_MODEL_DIR=${KVCORE_MODEL_DIR:-$SGDEV/models/qwen3-0.6b}
    # SGLang's default radix tree core is its Rust one, whose binary (tch) was built for a
    # newer torch: on the image's torch 2.11 it panics on the first tensor it reads
    # ("UnknownKind(18)"). SGLang's Python tree core runs instead, with elastic KV on and off
    # (elastic mode picks it anyway: kvcore.adapters.sglang.eviction).
    export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
    export PATH="$SGDEV/site/bin:$PATH"
    exec "$@" ;;
  *) sed -n '2,18p' "$0"; exit 2 ;;
esac
