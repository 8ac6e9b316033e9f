#!/usr/bin/env bash
# On the GPU machine (docs/GPU.md), in the repository root: `part1` keeps the first half of
# TVM's wheel in .gpu/keep, which stays between calls while the machine is warm;
# `part2` joins the halves and installs everything into /tmp/site (then
# `export PYTHONPATH=/tmp/site:$PWD`). Idempotent: a second `part2` on a warm machine
# installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  part1) mkdir -p .gpu/keep && cp .gpu/part1/* .gpu/keep/ ;;
  part2)
    if [ ! -f /tmp/site/.installed ]; then
      cp .gpu/part2/* .gpu/keep/
      cat .gpu/keep/tvm.whl.a? > ".gpu/keep/$(cat .gpu/keep/tvm.name)"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .gpu/keep/*.whl
      touch /tmp/site/.installed
    fi ;;
  *) echo "usage: tools/gpu_install.sh part1|part2" >&2; exit 2 ;;
esac
