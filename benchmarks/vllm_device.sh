#!/usr/bin/env bash
# The forked vLLM on the GPU machine, from the parts benchmarks/vllm_bundle.py makes here.
#
#   bash benchmarks/vllm_device.sh unpack .vdev/0.33.0/part-1.tar    # one part per call,
#   bash benchmarks/vllm_device.sh unpack .vdev/0.33.0/part-2.tar    # calls back to back
#   bash benchmarks/vllm_device.sh run python3 -m pytest tests/engines/vllm -m gpu
#   bash benchmarks/vllm_device.sh run python3 -m benchmarks.vllm_serve --models ...
#   bash benchmarks/vllm_device.sh run python3 -m vllm.entrypoints.cli.main serve ...
#
# unpack: installs a part under $KVDEV (default /tmp/kvdev, kept while the machine stays
# warm): dependency wheels into $KVDEV/site, the vLLM tree and its xz-compressed kernels
# into $KVDEV/site, the offline model directories into $KVDEV/models. run: the command with
# that site and this checkout (kvcore, harness, benchmarks: the call carries the working
# tree, the parts carry none of it) first on PYTHONPATH and the offline settings vLLM
# needs there (no hub; no flashinfer, so torch's sampler), KVCORE_MODEL_DIR set to the
# Qwen3-0.6B-shaped model. `status` says which parts are in. A file the bundle split into
# pieces (NAME.K-of-N, in different parts) is joined once its last piece is unpacked. `pack
# [DIR]`, last in a call: DIR's (default $OUT's) files into one results.tar (8 come back).
set -euo pipefail
KVDEV=${KVDEV:-/tmp/kvdev}
repo=$(cd "$(dirname "$0")/.." && pwd)

DEV=$KVDEV
# shellcheck source=benchmarks/device_parts.sh
source "$repo/benchmarks/device_parts.sh"

member() {  # install one bundle member (a file under $tmp)
  local f=$1 dest
  case "$f" in
    */wheels.tar | */wheels.tar.xz | */models.tar.xz) shared_member "$f" ;;
    */vllm-py.tar.xz) tar -xJf "$f" -C "$KVDEV/site" ;;
    *.so.xz)  # the file name is the module's path with / written as %
      dest="$KVDEV/site/$(basename "$f" .xz | tr '%' '/')"
      mkdir -p "$(dirname "$dest")"
      xz -dc "$f" >"$dest" ;;
    *) echo "vllm_device.sh: unknown bundle member $f" >&2; exit 2 ;;
  esac
}

case "${1:-}" in
  unpack) shift; for p in "$@"; do unpack "$p"; done ;;
  status) status ;;
  pack) pack "${2:-${OUT:?pack needs a folder or \$OUT}}" ;;
  run)
    shift
    export PYTHONPATH="$KVDEV/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
    export VLLM_TARGET_DEVICE=cuda VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export KVCORE_MODEL_DIR=${KVCORE_MODEL_DIR:-$KVDEV/models/qwen3-0.6b}
    export PATH="$KVDEV/site/bin:$PATH"
    exec "$@" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
