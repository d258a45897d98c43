#!/usr/bin/env bash
# tests/deepspeed/test_deepspeed.py in a venv of its own: see scripts/venv_ci.sh.
exec bash "$(dirname "$0")/venv_ci.sh" deepspeed "$@"
