#!/usr/bin/env bash
# Lists, for each .so in an sgl_kernel package, the C++ c10/at/torch/caffe2 symbols it imports
# that a torch install's lib/ does not define (and, given a shim .so, that the shim doesn't either).
#
#   bash nm_check.sh SGL_KERNEL_DIR TORCH_LIB_DIR [SHIM_SO]
#
# e.g. bash nm_check.sh /tmp/sglc-sk/sgl_kernel /tmp/sglc-t211/torch/lib /tmp/sglc-build/libtorch211_compat.so
# Needs nm and c++filt (binutils). Exit status 1 if anything is missing.
set -euo pipefail
SK="$1"; TL="$2"; SHIM="${3:-}"
T="$(mktemp -d /tmp/sglc-nmcheck.XXXXXX)"; trap 'rm -rf "$T"' EXIT
for l in "$TL"/*.so*; do nm -D --defined-only "$l" 2>/dev/null | awk '{print $NF}'; done | sed 's/@.*//' | sort -u > "$T/defs"
if [[ -n "$SHIM" ]]; then nm -D --defined-only "$SHIM" | awk '{print $NF}' | sort -u > "$T/shim"; else : > "$T/shim"; fi
sort -u "$T/defs" "$T/shim" > "$T/all"
status=0
while IFS= read -r so; do
  nm -D --undefined-only "$so" | awk '{print $NF}' | sed 's/@.*//' | sort -u > "$T/und"
  n_torch="$(grep -E '^_Z' "$T/und" | c++filt | grep -cE '(^|[^a-z_])(c10|at|torch|caffe2)::' || true)"
  comm -23 "$T/und" "$T/all" | grep -E '^_Z' > "$T/miss" || true
  # keep the torch ones (c++filt per line keeps the mangled name beside the demangled one)
  : > "$T/miss_torch"
  while IFS= read -r m; do
    d="$(echo "$m" | c++filt)"
    if echo "$d" | grep -qE '(^|[^a-z_])(c10|at|torch|caffe2)::'; then printf '%s\n    %s\n' "$d" "$m" >> "$T/miss_torch"; fi
  done < "$T/miss"
  k="$(grep -c '^    ' "$T/miss_torch" || true)"
  echo "== ${so#$SK/}: imports $n_torch c10/at/torch/caffe2 symbols; missing: $k"
  sed 's/^/  /' "$T/miss_torch"
  [[ "$k" == 0 ]] || status=1
done < <(find "$SK" -name '*.so' | sort)
exit $status
