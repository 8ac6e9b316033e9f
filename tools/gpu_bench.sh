#!/usr/bin/env bash
# On the GPU machine (docs/GPU.md), after `tools/gpu_install.sh part2`, in the repository
# root: `bash tools/gpu_bench.sh MODEL...` runs `collage-tvm bench` for each zoo model on
# the GPU (tvm, cudnn, cublas, inductor), each within PER_MODEL_S seconds (default 540:
# a `run` call may last 600), and leaves in $OUT what the device tool brings back (at most
# 8 files): costs.db (carry it to the next call as .gpu/costs.db: the costs found so far),
# bench.tgz (each model's results.json/.md and the placement log) and log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: tools/gpu_bench.sh MODEL..." >&2; exit 2; }
: "${OUT:?OUT is the folder the device tool brings back}"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
work=$(mktemp -d)
[ -f .gpu/costs.db ] && cp .gpu/costs.db "$work/costs.db"
[ -f .gpu/costs.db.placements.json ] && cp .gpu/costs.db.placements.json "$work/"
status=0
for m in "$@"; do
  echo "== $m ($(date -u +%H:%M:%S))"
  timeout "${PER_MODEL_S:-540}" python3 -m collage_tvm.cli bench "$m" --target cuda \
    --backends "${BACKENDS:-tvm,cudnn,cublas,inductor}" --out "$work/$m" \
    --db "$work/costs.db" ${BENCH_FLAGS:-} || { status=$?; echo "== $m: exit $status"; }
done
for f in costs.db costs.db.placements.json; do [ -f "$work/$f" ] && cp "$work/$f" "$OUT/"; done
tar czf "$OUT/bench.tgz" -C "$work" --exclude='*.onnx' --exclude='costs.db*' . 2>/dev/null
exit "$status"
