#!/usr/bin/env bash
# SGLang on the GPU machine: kvcore's `gpu` tests against the real SGLang pool and allocators
# (tests/engines/sglang/test_gpu.py) and the allocator benchmark on CUDA, from a bundle made
# here by benchmarks/device_bundle.py (the GPU machine has no SGLang and no network).
#
#   bash benchmarks/sglang_gpu.sh .sgdev/bundle.tar.gz "$OUT"
#
# SGLang imports CUDA-only wheels (sgl_kernel, ...) at module level there; the loop below finds
# each one the test modules import and names it in KVCORE_IMPORT_ONLY, which
# tests/engines/sglang/gpu_shim/sitecustomize.py turns into an import-only stand-in (calling
# anything of it raises, so no test can pass on a stub). Results: $OUT/sglang-gpu-tests.txt,
# $OUT/sglang-gpu-alloc.json, $OUT/sglang-import-only.txt.
set -u
bundle=${1:?bundle.tar.gz from benchmarks/device_bundle.py}
out=${2:?output directory}
site=$(mktemp -d)
tar -xzf "$bundle" -C "$site"
export PYTHONPATH=$PWD/tests/engines/sglang/gpu_shim:$site/site:$PWD/tests/engines/sglang/shim:$PWD
export KVCORE_IMPORT_ONLY=sgl_kernel
probe="import harness.sglang_kv, tests.engines.sglang.harness, tests.engines.sglang.test_gpu"
for _ in $(seq 25); do
  missing=$(python3 -c "$probe" 2>&1 | grep -o "No module named '[^']*'" | head -1 |
    sed "s/No module named '\([^'.]*\).*/\1/")
  [ -z "$missing" ] && break
  case "$missing" in sglang | kvcore | harness | tests | torch)
    echo "a part of $missing itself is missing: rebuild the bundle"; break ;;
  esac
  KVCORE_IMPORT_ONLY=$KVCORE_IMPORT_ONLY,$missing
done
echo "KVCORE_IMPORT_ONLY=$KVCORE_IMPORT_ONLY" | tee "$out/sglang-import-only.txt"
KVCORE_SGLANG_EXPECT=patched timeout 300 python3 -m pytest tests/engines/sglang -m gpu -v \
  -p no:cacheprovider -rs 2>&1 | tee "$out/sglang-gpu-tests.txt" | tail -25
timeout 240 python3 -m benchmarks.sglang_alloc --device cuda --repeats 15 --iters 50 \
  --json "$out/sglang-gpu-alloc.json" 2>&1 | tail -15
