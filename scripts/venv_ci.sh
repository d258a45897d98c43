#!/usr/bin/env bash
# Test modules that need an optional stack, in a venv of its own: torch 2.13.0 (never
# replaced, via a constraints file) plus the stack. The default .venv has neither, so
# there those tests are skipped.
#
#   scripts/venv_ci.sh deepspeed|bergson|olmo          # install, test, delete the venv
#   scripts/venv_ci.sh deepspeed|bergson|olmo install  # with CI_VENV_DIR set: only make
#                                                      # $CI_VENV_DIR/<stack> (CI, in the background)
#   scripts/venv_ci.sh deepspeed|bergson|olmo test     # with CI_VENV_DIR set: test in it
#                                                      # (installs first if it is missing)
#
# deepspeed: every stack that runs a DeepSpeed engine, in one venv and one pytest session
# (so its case modules share one launch per world size; DeepSpeed's CPU shm op, for
# inference alone, is never built: scripts/deepspeed_no_shm_op.py): tests/deepspeed/test_deepspeed.py (ZeRO-0 to 3, the seams grid, the Trainer and
# accelerate examples), tests/clients/test_lightning_deepspeed.py (Lightning's
# DeepSpeedStrategy), tests/clients/test_trl.py (TRL's SFTTrainer, DDP and ZeRO-2) and
# tests/clients/test_sentence_transformers.py (examples/sentence_transformers_cached.py:
# FSDP2 and FSDP1, DDP, DeepSpeed ZeRO-1/2/3 through the Trainer integration), with the
# deepspeed, trl and st extras (DeepSpeed built without ops, DS_BUILD_OPS=0;
# sentence-transformers[train] 6.2.0: datasets, accelerate) and transformers for the
# tiny Qwen2 (in the test extra).
# bergson: tests/clients/test_bergson.py (examples/influence_bergson.py, FSDP2 and FSDP1) with
# bergson 2.5.1, which brings transformers. bergson declares torchvision and torchaudio
# but never imports them, and with the CPU torch the registry's torchvision breaks
# `import transformers` (`operator torchvision::nms does not exist`): they are uninstalled.
# olmo: tests/clients/test_olmo_core.py (OLMo-core's own Transformer, apply_ddp and apply_fsdp)
# with ai2-olmo-core 3.0.0 (its base install: no extra is needed on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_install.sh
stack=${1:?usage: scripts/venv_ci.sh deepspeed|bergson|olmo [install|test]}
step=${2:-all}
case "$stack" in
  deepspeed) extras=(deepspeed trl st test) packages=() unwanted=()
    tests=(tests/deepspeed/test_deepspeed.py tests/clients/test_lightning_deepspeed.py
           tests/clients/test_trl.py tests/clients/test_sentence_transformers.py) ;;
  bergson) extras=(test) packages=(bergson==2.5.1) unwanted=(torchvision torchaudio)
    tests=(tests/clients/test_bergson.py) ;;
  olmo) extras=(test) packages=(ai2-olmo-core==3.0.0) unwanted=() tests=(tests/clients/test_olmo_core.py) ;;
  *) echo "unknown stack: $stack" >&2; exit 2 ;;
esac
if [ -n "${CI_VENV_DIR:-}" ] && [ "$step" != all ]; then
  work="$CI_VENV_DIR/$stack"
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
if [ ! -f "$work/installed" ]; then
  rm -rf "$work/venv"
  printf 'torch==2.13.0\n' > "$work/constraints.txt"
  venv_make "$work/venv"
  # A machine-wide pip constraint gives way to this venv's own (scripts/venv_install.sh).
  DS_BUILD_OPS=0 venv_pip "$work/venv" -c "$work/constraints.txt" torch==2.13.0 "${packages[@]}"
  DS_BUILD_OPS=0 venv_project "$work/venv" -c "$work/constraints.txt" "${extras[@]}"
  [ ${#unwanted[@]} = 0 ] || venv_pip_uninstall "$work/venv" "${unwanted[@]}"
  if [ "$stack" = deepspeed ]; then
    # DeepSpeed's CPU shm all-reduce op (inference only) is never built in this venv: every
    # process imports the hook at start (scripts/deepspeed_no_shm_op.py, its note).
    site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp scripts/deepspeed_no_shm_op.py "$site/fsdp_retain_ci_no_shm_op.py"
    echo "import fsdp_retain_ci_no_shm_op" > "$site/fsdp_retain_ci_no_shm_op.pth"
  fi
  touch "$work/installed"
fi
[ "$step" = install ] && exit 0
# A JIT-built DeepSpeed op would land in TORCH_EXTENSIONS_DIR: one of its own per venv
# (venvs sharing one rebuild it). None is built in CI's (the shm op's hook, above).
export TORCH_EXTENSIONS_DIR="$work/torch_extensions"
"$work/venv/bin/python" -m pytest -q "${tests[@]}"
