#!/usr/bin/env bash
# Packs the part of the sglang-kernel 0.4.10 wheel that `import sgl_kernel` needs on an H200
# (sm90): the Python files, sm90/common_ops.abi3.so and the dist-info (SGLang checks the
# version through importlib.metadata). Left out: flash_ops (FA3, 1.1 GB), flashmla_ops,
# infllm_ops, spatial_ops (all loaded lazily, and not by a dense model) and sm100/.
#
#   bash pack_sgl_kernel.sh [--no-binary] OUT.tar.xz [WHEEL]
# --no-binary leaves common_ops.abi3.so out too: the Python files and dist-info only, for
# standin/common_ops.py (torch ops in its place; see its docstring). WHEEL defaults to a fresh `pip download --no-deps sglang-kernel==0.4.10` into /tmp/sglc-wheels.
# On the device: mkdir -p /tmp/sk && tar -xJf OUT.tar.xz -C /tmp/sk && export PYTHONPATH=/tmp/sk
set -euo pipefail
BINARY=1
if [[ "${1:-}" == "--no-binary" ]]; then BINARY=0; shift; fi
OUT="$1"; WHEEL="${2:-}"
if [[ -z "$WHEEL" ]]; then
  mkdir -p /tmp/sglc-wheels
  WHEEL="$(ls /tmp/sglc-wheels/sglang_kernel-0.4.10-*.whl 2>/dev/null | head -1 || true)"
  if [[ -z "$WHEEL" ]]; then
    pip download --no-deps sglang-kernel==0.4.10 -d /tmp/sglc-wheels >/dev/null
    WHEEL="$(ls /tmp/sglc-wheels/sglang_kernel-0.4.10-*.whl | head -1)"
  fi
fi
T="$(mktemp -d /tmp/sglc-pack.XXXXXX)"; trap 'rm -rf "$T"' EXIT
# (unzip's * also matches '/', so this takes the subpackages' .py files too)
MEMBERS=('sgl_kernel/*.py' 'sglang_kernel-0.4.10.dist-info/*')
if [[ $BINARY == 1 ]]; then MEMBERS+=('sgl_kernel/sm90/common_ops.abi3.so'); fi
(cd "$T" && unzip -q "$WHEEL" "${MEMBERS[@]}")
(cd "$T" && tar -cf - sgl_kernel sglang_kernel-0.4.10.dist-info) | xz -9 -T2 > "$OUT"
ls -l "$OUT"
