#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index: DeepSpeed and what it needs
# beyond what such an image usually holds (torch, ninja, numpy, psutil, py-cpuinfo, msgpack,
# einops, tqdm, nvidia-ml-py), into .whl/ at the repository root (git-ignored).
#
#   bash benchmarks/gpu_wheels.sh                        # CPython 3.12 on x86-64 Linux
#   PYVER=3.11 bash benchmarks/gpu_wheels.sh             # another Python there
#
# There, before the suite:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash benchmarks/gpu_suite.sh
#
# DeepSpeed is built here as a pure-Python wheel (no op compiled in: an op built against this
# machine's torch would not load beside another). The suite compiles its CPU Adam on the GPU
# machine while the smoke test runs (gpu_suite.py, CpuAdamBuild), with that machine's torch
# and compiler.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.whl"
pyver="${PYVER:-3.12}"
python="${PYTHON:-python3}"
deepspeed="${DEEPSPEED:-deepspeed==0.19.8}"
mkdir -p "$dest"
platforms=()
for n in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$n")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d "$dest" hjson pydantic pydantic-core annotated-types typing-inspection
# setup.py imports torch: build against the torch installed here, not a fresh download
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$deepspeed"
ls -1 "$dest"
