#!/usr/bin/env bash
# One command that validates fsdp_retain on this machine's GPUs and writes
# docs/results/<gpu>-torch<version>-<date>/ (see docs/gpu_validation.md):
#   bash scripts/gpu_validate.sh                        # all stages (resumes an unfinished folder)
#   bash scripts/gpu_validate.sh --stage env parity report
#   bash scripts/gpu_validate.sh --dry-run              # tiny, CPU/gloo, temporary folder
# PYTHON picks the interpreter (default: python3); nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_validate.py "$@"
