#!/usr/bin/env bash
# DeepSpeed and what it needs beyond torch and numpy, as wheels, for a GPU machine that
# reaches no package index (the device machine: docs/gpu_validation.md). Built here, on
# CPU; the GPU kit (scripts/gpu_validate.sh) installs it into a throwaway venv over the
# machine's own torch (python -m venv --system-site-packages) when deepspeed is missing.
#
#   bash scripts/gpu_wheelhouse.sh              # into wheelhouse/ (ignored by git)
#   bash scripts/gpu_wheelhouse.sh DIR
#
# deepspeed itself is a pure-Python wheel (DS_BUILD_OPS=0: no op compiled ahead of time);
# its compiled dependencies (msgpack, psutil, pydantic-core, ninja) are fetched for CPython
# 3.10 to 3.13 on x86_64 Linux. It prints the folder's size: it must stay under the
# 64 MiB that travels with the checkout (tests/repo/test_gpu_validate.py checks the list).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-wheelhouse}
mkdir -p "$out"
pip=${PIP:-python3 -m pip}
# The pins the suite ran DeepSpeed with (pyproject.toml's deepspeed extra).
deepspeed=$(python3 -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); print(d["project"]["optional-dependencies"]["deepspeed"][0])')
DS_BUILD_OPS=0 PIP_CONSTRAINT=/dev/null $pip wheel -q --no-deps -w "$out" "$deepspeed"
# What deepspeed requires, less torch and numpy (the GPU machine's own); pip fetches their
# own needs (pydantic's), which scripts/gpu_validate_deps.py's DEEPSPEED_NEEDS names.
deps=(einops hjson msgpack ninja packaging psutil py-cpuinfo pydantic tqdm)
for version in 3.10 3.11 3.12 3.13; do
  PIP_CONSTRAINT=/dev/null $pip download -q --only-binary=:all: -d "$out" \
    --python-version "$version" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 "${deps[@]}"
done
du -sh "$out"
size=$(du -sm "$out" | cut -f1)
[ "$size" -lt 64 ] || { echo "wheelhouse: $size MiB, past the 64 MiB that travel" >&2; exit 1; }
ls "$out"
