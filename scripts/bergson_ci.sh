#!/usr/bin/env bash
# tests/clients/test_bergson.py in a venv of its own: see scripts/venv_ci.sh.
exec bash "$(dirname "$0")/venv_ci.sh" bergson "$@"
