# Unpacking a bundle part on the GPU machine: sourced by vllm_device.sh and sglang_device.sh.
#
# The sourcing script sets DEV (the folder a bundle installs into, kept while the machine
# stays warm) and defines `member FILE`, which installs one bundle member (`shared_member`
# installs the dependency wheels, wheels.tar.xz or an older bundle's wheels.tar, into
# $DEV/site and the model directories into $DEV). `unpack PART` extracts a part and hands
# each member to `member`; a file the bundle split into pieces (NAME.K-of-N, in different
# parts, benchmarks/vllm_bundle.py's split_member) is kept under $DEV/pieces and joined and
# installed once its last piece is here. $DEV/parts lists the parts unpacked so far
# (`status`). `pack DIR` folds what a call wrote under DIR (the device tool's $OUT) into one
# DIR/results.tar: the tool brings back at most 8 files.

shared_member() {  # the wheels and models.tar.xz, which every bundle has
  case "$1" in
    */wheels.tar | */wheels.tar.xz)  # .xz: the wheels stored, one stream over them all
      tar -xf "$1" -C "$tmp"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$DEV/site" "$tmp"/wheels/*.whl ;;
    */models.tar.xz) tar -xJf "$1" -C "$DEV" ;;
  esac
}

piece() {  # keep a piece (NAME.K-of-N); once all N are here, join and install NAME
  local f=$1 name k n i
  name=$(basename "$f"); n=${name##*-of-}; k=${name%-of-*}; k=${k##*.}; name=${name%.*-of-*}
  mkdir -p "$DEV/pieces"
  mv "$f" "$DEV/pieces/"
  for i in $(seq 1 "$n"); do
    [ -e "$DEV/pieces/$name.$i-of-$n" ] || { echo "kept piece $k of $n of $name"; return; }
  done
  for i in $(seq 1 "$n"); do cat "$DEV/pieces/$name.$i-of-$n"; done >"$tmp/$name"
  rm -f "$DEV/pieces/$name".*-of-"$n"
  member "$tmp/$name"
  echo "joined $n pieces of $name"
}

unpack() {
  local part=$1 f
  tmp=$(mktemp -d)
  tar -xf "$part" -C "$tmp"
  mkdir -p "$DEV/site" "$DEV/parts"
  for f in "$tmp"/*; do
    case "$f" in
      *.[0-9]*-of-[0-9]*) piece "$f" ;;
      *) member "$f" ;;
    esac
  done
  touch "$DEV/parts/$(basename "$part")"
  rm -rf "$tmp"
  echo "unpacked $(basename "$part") into $DEV"
}

status() {
  ls "$DEV/parts" 2>/dev/null || echo "nothing unpacked in $DEV"
}

pack() {  # fold every file under folder $1 into $1/results.tar (the device tool returns 8)
  local out=$1 list
  [ -d "$out" ] || { echo "pack: no folder $out" >&2; return 2; }
  list=$(mktemp)
  (cd "$out" && find . -type f ! -path ./results.tar | sort >"$list" &&
    if [ -s "$list" ]; then tar -rf results.tar -T "$list" && xargs -r rm -f <"$list"; fi &&
    find . -mindepth 1 -type d -empty -delete)
  rm -f "$list"
  echo "packed into $out/results.tar: $(tar -tf "$out/results.tar" | wc -l) files"
}
