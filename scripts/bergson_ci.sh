#!/usr/bin/env bash
# tests/test_bergson.py (examples/influence_bergson.py, FSDP2 and FSDP1) in a throwaway
# venv: torch 2.13.0 (never replaced, via a constraints file) and bergson 2.5.1, which
# brings transformers. bergson declares torchvision and torchaudio but never imports
# them, and with the CPU torch the registry's torchvision breaks `import transformers`
# (`operator torchvision::nms does not exist`): they are uninstalled. The default .venv
# has no bergson, so there the test is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf 'torch==2.13.0\n' > "$work/constraints.txt"
python3 -m venv "$work/venv"
# PIP_CONSTRAINT=/dev/null: a machine-wide pip constraint gives way to this venv's own.
PIP_CONSTRAINT=/dev/null "$work/venv/bin/pip" install -q -c "$work/constraints.txt" \
    torch==2.13.0 -e '.[test]' bergson==2.5.1
"$work/venv/bin/pip" uninstall -q -y torchvision torchaudio
"$work/venv/bin/python" -m pytest -q tests/test_bergson.py
