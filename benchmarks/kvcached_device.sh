#!/usr/bin/env bash
# kvcached (the anchor of issue 20, item 6) on the GPU machine, beside vLLM 0.30.0's bundle.
#
#   KVDEV=/tmp/kvdev030 bash benchmarks/vllm_device.sh unpack .vdev/0.30.0-upstream/part-1.tar
#   KVDEV=/tmp/kvdev030 bash benchmarks/vllm_device.sh unpack .vdev/0.30.0-upstream/part-2.tar
#   KVDEV=/tmp/kvdev030 bash benchmarks/kvcached_device.sh install .vdev/kvcached
#   KVDEV=/tmp/kvdev030 KVCACHED_IPC_NAME=kvc_a bash benchmarks/kvcached_device.sh run \
#       python3 -m vllm.entrypoints.cli.main serve ...
#
# install: builds kvcached's sdist with the image's torch and nvcc (no build isolation, no
# index) into $KVDEV/site, with the dependency wheels beside it in the same folder
# (.vdev/kvcached: kvcached-0.1.6.tar.gz, posix_ipc and wrapt cp312 wheels, made here with
# pip download). run: vllm_device.sh's run with kvcached turned on in every Python process
# (benchmarks/kvcached_boot/sitecustomize.py adds $KVDEV/site as a site directory, so its
# kvcached_autopatch.pth runs), ENABLE_KVCACHED and KVCACHED_AUTOPATCH set. Each instance
# needs its own KVCACHED_IPC_NAME (docs/colocation-gpu.md, "kvcached side by side").
set -euo pipefail
KVDEV=${KVDEV:-/tmp/kvdev030}
repo=$(cd "$(dirname "$0")/.." && pwd)
export KVDEV

case "${1:-}" in
  install)
    dir=${2:?usage: kvcached_device.sh install DIR}
    stubs=/usr/local/cuda/lib64/stubs
    LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}" \
      bash "$repo/benchmarks/vllm_device.sh" run python3 -m pip install --no-deps \
      --no-build-isolation --no-index --target "$KVDEV/site" --upgrade "$dir"/*.whl \
      "$dir"/kvcached-*.tar.gz
    ls "$KVDEV/site" | grep -i -E "kvcached|posix_ipc|wrapt" ;;
  run)
    shift
    export KVCACHED_SITE="$KVDEV/site" ENABLE_KVCACHED=true KVCACHED_AUTOPATCH=1
    export PYTHONPATH="$repo/benchmarks/kvcached_boot${PYTHONPATH:+:$PYTHONPATH}"
    exec bash "$repo/benchmarks/vllm_device.sh" run "$@" ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
