# Sourced by scripts/torch_matrix.sh and scripts/venv_ci.sh: make a throwaway venv and
# install into it, with uv where it can be had (a torch build with its CUDA packages
# in ~20 s, where pip takes several minutes), else with pip.
#
#   venv_make DIR                      # a venv at DIR
#   venv_pip DIR ARGS...               # `pip install ARGS...` into it (-c FILE works)
#   venv_pip_uninstall DIR PACKAGE...
#
# uv reads none of pip's settings: the index, extra indexes and find-links that pip is
# configured with (pip config list, PIP_* variables) are passed on, and a machine-wide
# pip constraint is not (these venvs pin their own torch). FSDP_RETAIN_NO_UV=1: pip only.

_uv=""
_uv_args=()

_venv_find_uv() {
  [ -n "$_uv" ] && return 0
  [ "${FSDP_RETAIN_NO_UV:-0}" = 1 ] && return 1
  if command -v uv >/dev/null 2>&1; then
    _uv=$(command -v uv)
  else
    local tool=${CI_VENV_DIR:-${TMPDIR:-/tmp}}/fsdp_retain_uv
    if [ ! -x "$tool/bin/uv" ]; then
      { python3 -m venv "$tool" && "$tool/bin/pip" install -q uv; } >/dev/null 2>&1 ||
        { rm -rf "$tool"; return 1; }
    fi
    _uv=$tool/bin/uv
  fi
  # CI: the cache beside the venvs (same disk: uv links from it), deleted with them.
  [ -z "${CI_VENV_DIR:-}" ] || export UV_CACHE_DIR=${UV_CACHE_DIR:-$CI_VENV_DIR/uv-cache}
  # pip's index settings, as uv flags; pip's order of preference among indexes.
  _uv_args=(--index-strategy unsafe-best-match)
  local key value
  while IFS='=' read -r key value; do
    value=${value#\'}
    value=${value%\'}
    for value in $value; do
      case "$key" in
        *.index-url | *.extra-index-url)
          [[ $value == file://* && ! -d ${value#file://} ]] && continue
          [[ $key == *.index-url && $key != *extra* ]] && _uv_args+=(--index-url "$value") ||
            _uv_args+=(--extra-index-url "$value")
          ;;
        *.find-links) [ -e "$value" ] && _uv_args+=(--find-links "$value") ;;
      esac
    done
  done < <(python3 -m pip config list 2>/dev/null)
  return 0
}

venv_make() {
  if _venv_find_uv; then
    "$_uv" venv -q --seed -p python3 "$1"  # --seed: pip and setuptools, as python -m venv (inductor imports setuptools)
  else
    python3 -m venv "$1"
  fi
}

venv_pip() {
  local venv=$1
  shift
  if _venv_find_uv; then
    UV_NATIVE_TLS=1 "$_uv" pip install -q -p "$venv/bin/python" "${_uv_args[@]}" "$@"
  else
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "$@"
  fi
}

venv_pip_uninstall() {
  local venv=$1
  shift
  if _venv_find_uv; then
    "$_uv" pip uninstall -q -p "$venv/bin/python" "$@"
  else
    "$venv/bin/python" -m pip uninstall -q -y "$@"
  fi
}

# venv_project DIR [-c FILE] EXTRA...: this checkout with those extras, as `pip install
# -e '.[EXTRA,...]'` would make it. With uv: the dependencies read from pyproject.toml
# and a .pth naming the checkout, so nothing is built in the source tree (CI's main
# chain is installing it editable at the same time).
venv_project() {
  local venv=$1
  shift
  local opts=() extras=()
  while [ $# -gt 0 ]; do
    if [ "$1" = -c ]; then opts+=(-c "$2"); shift 2; else extras+=("$1"); shift; fi
  done
  if _venv_find_uv; then
    local e flags=()
    for e in "${extras[@]}"; do flags+=(--extra "$e"); done
    venv_pip "$venv" "${opts[@]}" -r pyproject.toml "${flags[@]}" &&
      "$venv/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/fsdp_retain_checkout.pth", "w").write(sys.argv[1] + "\n")' "$(pwd)"
  else
    local joined
    joined=$(IFS=,; echo "${extras[*]}")
    venv_pip "$venv" "${opts[@]}" -e ".[$joined]"
  fi
}
