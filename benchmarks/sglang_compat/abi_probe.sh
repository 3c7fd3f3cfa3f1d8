#!/usr/bin/env bash
# Compiles abi_probe.cpp against two torch header trees and prints the lines that differ.
#   bash abi_probe.sh TORCH_DIR_A TORCH_DIR_B    (each a torch package dir with include/)
# torch >= 2.13 headers need C++20, so both are built with -std=c++20 (the layout is the same
# under C++17 for 2.11). Exit status 1 if anything differs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
T="$(mktemp -d /tmp/sglc-abiprobe.XXXXXX)"; trap 'rm -rf "$T"' EXIT
for i in 1 2; do
  d="${!i}"
  g++ -std=c++20 -w -D_GLIBCXX_USE_CXX11_ABI=1 -I"$d/include" "$HERE/abi_probe.cpp" -o "$T/p$i"
  "$T/p$i" > "$T/o$i"
done
echo "# left: $1    right: $2"
diff -y --suppress-common-lines -W 120 "$T/o1" "$T/o2" && echo "(no differences)"
