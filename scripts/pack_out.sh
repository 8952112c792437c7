#!/usr/bin/env bash
# Last command of a device call (GPU machine): the device tool brings back at most 8 files from
# $OUT, so this packs every file there into one $OUT/logs.tar.gz (`tar xzf` it here). A call
# that runs A/Bs writes two files per run and loses the rest otherwise.
set -euo pipefail
OUT=${OUT:-/tmp/out}
cd "$OUT"
mapfile -t files < <(find . -type f ! -name logs.tar.gz | sort)
[ "${#files[@]}" -eq 0 ] && exit 0
tar czf logs.tar.gz "${files[@]}"
rm -f "${files[@]}"
find . -mindepth 1 -type d -empty -delete
echo "pack_out: ${#files[@]} files in $OUT/logs.tar.gz"
