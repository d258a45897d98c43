#!/usr/bin/env bash
# tests/test_deepspeed.py in a throwaway venv: torch 2.13.0 (never replaced, via a
# constraints file), the pinned deepspeed extra built without ops, transformers for the
# tiny Qwen2 (in the test extra). The default .venv has no deepspeed, so there those cases are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf 'torch==2.13.0\n' > "$work/constraints.txt"
python3 -m venv "$work/venv"
# PIP_CONSTRAINT=/dev/null: a machine-wide pip constraint gives way to this venv's own.
PIP_CONSTRAINT=/dev/null DS_BUILD_OPS=0 "$work/venv/bin/pip" install -q -c "$work/constraints.txt" \
    torch==2.13.0 -e '.[deepspeed,test]'
"$work/venv/bin/python" -m pytest -q tests/test_deepspeed.py
