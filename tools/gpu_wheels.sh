#!/usr/bin/env bash
# Prepare, on a machine that reaches the package index, what a GPU machine without TVM needs
# (docs/GPU.md): the wheels collage-tvm needs that its image lacks, for Python 3.12, in .gpu/
# (git-ignored). TVM's wheel (~100 MB) is over one transfer's 64 MiB: it is cut in two,
# .gpu/part1 and .gpu/part2, each carried by one `run` call; tools/gpu_install.sh joins them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/dl .gpu/part1 .gpu/part2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/dl \
  apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post0 deap==1.4.4 \
  moocore==0.3.2 cffi==2.1.1 pycparser==3.12 platformdirs==4.14.8  # deap 1.4's tools import moocore
"$PY" -m pip download -q --no-deps -d .gpu/dl onnx2torch==1.5.15  # pure Python: the inductor backend
tvm=$(ls .gpu/dl/apache_tvm-*.whl)
split -b 52m "$tvm" .gpu/part1/tvm.whl. && rm "$tvm"
mv .gpu/part1/tvm.whl.ab .gpu/part2/
basename "$tvm" > .gpu/part1/tvm.name
mv .gpu/dl/*.whl .gpu/part2/
rm -rf .gpu/dl
du -sh .gpu/part1 .gpu/part2
