#!/usr/bin/env bash
# Builds libtorch211_compat.so from torch211_compat.cpp against a torch 2.11 install.
#
#   bash build.sh [TORCH_DIR] [OUT_DIR]
#
# TORCH_DIR: the torch package directory (holds include/ and lib/). Default: the one that
#            `python3 -c 'import torch'` finds (on the GPU machine: the image's torch 2.11.0).
#            Here it can be an unpacked torch 2.11.0 wheel's torch/ folder.
# OUT_DIR:   where the .so goes (default: this script's folder).
# Needs g++ (C++17) and, only for the checks at the end, nm. It needs neither nvcc nor CUDA headers.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TORCH_DIR="${1:-}"
OUT_DIR="${2:-$HERE}"
if [[ -z "$TORCH_DIR" ]]; then
  TORCH_DIR="$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
fi
INC="$TORCH_DIR/include"
LIB="$TORCH_DIR/lib"
for f in "$INC/torch/library.h" "$LIB/libc10.so" "$LIB/libc10_cuda.so" "$LIB/libtorch_cpu.so"; do
  [[ -e "$f" ]] || { echo "build.sh: missing $f (is $TORCH_DIR a torch package dir?)" >&2; exit 2; }
done

# Which torch is this? Read version.py instead of importing torch, so that an unpacked
# wheel (which lacks its dependencies) works too.
VER="$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$TORCH_DIR/version.py" 2>/dev/null || true)"
case "$VER" in
  2.11.*) ;;
  *) echo "build.sh: warning: torch version '$VER' is not 2.11.x; this shim is written for 2.11.0" >&2 ;;
esac

# _GLIBCXX_USE_CXX11_ABI must match torch's build. A libc10 built with the new ABI exports
# std::__cxx11::basic_string in its mangled names; torch 2.11's wheels do (torch has used the
# new ABI since 2.7; torch.compiled_with_cxx11_abi() says True).
if grep -qa '_ZN3c106detail14torchCheckFailEPKcS2_jRKNSt7__cxx1112basic_string' "$LIB/libc10.so"; then
  CXX11_ABI=1
else
  CXX11_ABI=0
fi

MAP="$(mktemp /tmp/sglc-exports.XXXXXX.map)"
trap 'rm -f "$MAP"' EXIT
# Export only the five symbols torch 2.11 lacks, plus a version marker. Everything else is made
# local: the weak C++ definitions that g++ emits here (NotImplementedError's vtable, std::vector
# helpers) would otherwise be exported and, under LD_PRELOAD, override torch's own copies.
cat > "$MAP" <<'MAPEOF'
{
  global:
    _ZN3c1019NotImplementedErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE;
    _ZN3c104cuda19CUDAErrorLogCaptureC1Ev;
    _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jbPNS0_19CUDAErrorLogCaptureE;
    _ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorINS_10headeronly3TagESaIS8_EENS_17_RegisterOrVerifyE;
    _ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorINS_10headeronly3TagESaISB_EE;
    torch211_compat_version;
  local: *;
};
MAPEOF

mkdir -p "$OUT_DIR"
OUT="$OUT_DIR/libtorch211_compat.so"
set -x
g++ -shared -fPIC -std=c++17 -O2 -Wall -Wextra -Werror \
  -D_GLIBCXX_USE_CXX11_ABI="$CXX11_ABI" \
  -I"$INC" \
  "$HERE/torch211_compat.cpp" -o "$OUT" \
  -L"$LIB" -Wl,--no-as-needed -lc10 -lc10_cuda -ltorch_cpu -Wl,--as-needed \
  -Wl,-rpath,"$LIB" -Wl,--version-script="$MAP" -Wl,-z,defs
set +x

# Checks (skipped where nm is absent):
# (a) it exports exactly the six names above;
# (b) every symbol it imports is defined by torch's lib/ or the C/C++ runtime (-z defs above already
#     made the link fail otherwise);
# (c) the 5-argument check it forwards to exists in this torch.
if command -v nm >/dev/null; then
  echo "exported:"; nm -D --defined-only "$OUT" | awk '{print "  " $3}'
  n="$(nm -D --defined-only "$OUT" | wc -l)"
  [[ "$n" == 6 ]] || { echo "build.sh: expected 6 exported symbols, got $n" >&2; exit 3; }
  # (grep without -q: with pipefail, -q's early exit would make nm die of SIGPIPE and fail the test)
  nm -D --defined-only "$LIB/libc10_cuda.so" | grep ' _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb$' >/dev/null \
    || { echo "build.sh: this torch lacks the 5-arg c10_cuda_check_implementation" >&2; exit 3; }
fi
echo "built $OUT (torch ${VER:-?}, _GLIBCXX_USE_CXX11_ABI=$CXX11_ABI)"
