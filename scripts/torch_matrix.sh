#!/usr/bin/env bash
# Runs the test suite on each torch version given, one fresh venv per version,
# and records the result in docs/compat.json and docs/compat.md.
#
#   scripts/torch_matrix.sh 2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0
#   scripts/torch_matrix.sh --subset 2.9.1 2.15.0   # the CI subset (see tests/matrix_subset.txt)
#   scripts/torch_matrix.sh --install-only 2.9.1 2.15.0   # only make the venvs (CI, in the
#                                                         # background); a later run reuses them
#
# Each venv gets `pip install torch==VERSION` (uv where it can be had:
# scripts/venv_install.sh), then the project with its test
# extra under a constraint that pins that torch (so nothing replaces
# it), runs `python -m pytest -q`, and is deleted afterwards (KEEP_VENVS=1 keeps
# it). Registry builds of torch carry CUDA but run on CPU; each venv is ~5 GB.
# Recording, it measures the machine's calibration in the venv just before the tests
# (python -m fsdp_retain.report calibrate), which compat.md shows beside the test time.
# MATRIX_RECORD=0 (CI) leaves docs/compat.* alone and skips it; MATRIX_VENV_DIR (default
# $TMPDIR or /tmp) is where the venvs go.
# A machine-wide pip constraint (e.g. torch<=2.14.1 in /etc/xdg/pip) would refuse the
# version asked for: these installs do not take it (uv does not read it; with pip,
# PIP_CONSTRAINT=/dev/null; index settings are kept) and pin the venv's own torch with
# their constraints file instead.
# Exit status: non-zero if any version failed to install or had a failing test.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source scripts/venv_install.sh

subset=0
install_only=0
if [ "${1:-}" = "--subset" ]; then
  subset=1
  shift
elif [ "${1:-}" = "--install-only" ]; then
  install_only=1
  shift
fi
if [ $# -eq 0 ]; then
  echo "usage: scripts/torch_matrix.sh [--subset | --install-only] VERSION..." >&2
  exit 2
fi

venv_root=${MATRIX_VENV_DIR:-${TMPDIR:-/tmp}}
python=${PYTHON:-python3}
pytest_args=(-q -p no:cacheprovider --durations=15)
if [ "$subset" = 1 ]; then
  mapfile -t subset_tests < <(grep -v '^\s*\(#\|$\)' tests/matrix_subset.txt)
  pytest_args+=("${subset_tests[@]}")
fi
status=0
# The code under test; "+changes" when the library or tests differ from it.
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
git diff --quiet HEAD -- fsdp_retain tests 2>/dev/null || commit="$commit+changes"

for version in "$@"; do
  venv="$venv_root/fsdp_retain_torch_$version"
  log="$venv_root/fsdp_retain_torch_$version.log"
  constraints="$venv_root/fsdp_retain_torch_$version.constraints"
  echo "== torch $version: venv $venv, log $log"
  start=$(date +%s)
  result=""
  : >"$log"
  if [ ! -x "$venv/bin/python" ]; then  # KEEP_VENVS=1 from an earlier run: reuse
    rm -rf "$venv"
    echo "torch==$version" >"$constraints"
    if ! { venv_make "$venv" &&
      venv_pip "$venv" "torch==$version" &&
      venv_project "$venv" -c "$constraints" test; } >>"$log" 2>&1; then
      result="install failed (see $log)"
    fi
  fi
  installed=$(date +%s)
  if [ "$install_only" = 1 ]; then
    echo "   ${result:-installed} ($((installed - start)) s)"
    [ -z "$result" ] || status=1
    continue
  fi
  if [ -z "$result" ]; then
    # The installed version, read without importing torch (4 s of CPU; the tests import it).
    got=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('torch').split('+')[0])")
    if [ "$got" != "$version" ]; then
      result="venv has torch $got, not $version"
    fi
  fi
  calibration=""
  if [ -z "$result" ] && [ "${MATRIX_RECORD:-1}" = 1 ]; then
    # The machine's speed, in this venv, just before its tests: recorded beside their time.
    calibration=$("$venv/bin/python" -m fsdp_retain.report calibrate 2>>"$log") || calibration=""
    echo "   $calibration"
  fi
  if [ -z "$result" ]; then
    "$venv/bin/python" -m pytest "${pytest_args[@]}" >>"$log" 2>&1
    rc=$?
    result=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    [ -n "$result" ] || result="pytest exited $rc with no summary (see $log)"
    [ "$rc" = 0 ] || status=1
  else
    status=1
  fi
  end=$(date +%s)
  echo "   $result (install $((installed - start)) s, tests $((end - installed)) s)"
  # Failures stay readable after the venv is gone.
  grep -E '^(FAILED|ERROR) ' "$log" | head -n 40
  if [ "${status}" != 0 ] && grep -qE '^_{3,} .* _{3,}$' "$log"; then
    # The first failure's report (each rank's error and output tail), for CI logs
    # that outlive the venv's log file.
    echo "   first failure, from $log:"
    awk '/^___+ .* ___+$/ {n++} n == 1' "$log" | grep -E '^E ' | head -n 120 | sed 's/^/   | /'
  fi
  [ "${MATRIX_RECORD:-1}" = 1 ] && "$python" scripts/compat_table.py --version "$version" --result "$result" \
    --seconds $((end - installed)) --subset "$subset" --calibration "$calibration" \
    --commit "$commit" --command "scripts/torch_matrix.sh $([ "$subset" = 1 ] && echo '--subset ')$version"
  if [ "${KEEP_VENVS:-0}" != 1 ]; then
    rm -rf "$venv" "$constraints"
  fi
done
[ "${MATRIX_RECORD:-1}" = 1 ] && [ "$install_only" = 0 ] && echo "wrote docs/compat.md"
exit $status
