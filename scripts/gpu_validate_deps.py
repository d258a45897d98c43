"""DeepSpeed for the GPU kit's ``stacks`` stage (``scripts/gpu_validate.py``): the python
that has it. The GPU machine may have no DeepSpeed and reach no package index, so the kit
installs it from ``wheelhouse/`` (``bash scripts/gpu_wheelhouse.sh``, built on a machine
that reaches one, carried with the checkout) into a throwaway venv over the machine's own
torch: ``python -m venv --system-site-packages``, plus a ``.pth`` naming this
interpreter's site-packages where it is itself a venv. Nothing is installed into the
machine's environment.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = ROOT / "wheelhouse"
# What deepspeed needs beyond torch and numpy, with their own needs: scripts/gpu_wheelhouse.sh
# fetches these.
DEEPSPEED_NEEDS = ("einops", "hjson", "msgpack", "ninja", "packaging", "psutil", "py-cpuinfo",
                   "pydantic", "pydantic-core", "annotated-types", "typing-extensions",
                   "typing-inspection", "tqdm")


def has_deepspeed(python: str) -> bool:
    code = "import deepspeed"
    return subprocess.run([python, "-c", code], capture_output=True, env=_quiet()).returncode == 0


def deepspeed_python(say, wheelhouse: Path = WHEELHOUSE) -> tuple[str | None, str]:
    """(the python that imports deepspeed, how it got it); ``(None, why)`` where it cannot."""
    if has_deepspeed(sys.executable):
        return sys.executable, "deepspeed was installed already"
    if not any(wheelhouse.glob("deepspeed-*.whl")):
        return None, ("deepspeed is not installed and wheelhouse/ has no deepspeed wheel: run "
                      "`bash scripts/gpu_wheelhouse.sh` on a machine with a package index and "
                      "bring wheelhouse/ with the checkout")
    venv = Path(tempfile.mkdtemp(prefix="gpu_validate_deepspeed_")) / "venv"
    say(f"deepspeed: installing it from {wheelhouse} into {venv} over this machine's torch")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    # This interpreter's packages (torch), also where it is a venv itself.
    mine = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]}
            if Path(p).is_dir()]
    Path(purelib.stdout.strip(), "gpu_validate_parent.pth").write_text("\n".join(mine) + "\n")
    # --no-deps: pip would otherwise check torch's own requirements against the venv's
    # seed packages (an older setuptools shadows the machine's); deepspeed's are named.
    proc = subprocess.run(
        [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse),
         "--no-deps", "deepspeed", *DEEPSPEED_NEEDS], capture_output=True, text=True,
        env={**_quiet(), "DS_BUILD_OPS": "0", "PIP_CONSTRAINT": "/dev/null"})
    if proc.returncode != 0 or not has_deepspeed(python):
        last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        return None, f"installing deepspeed from wheelhouse/ failed: {last[0]}"
    return python, f"deepspeed installed from wheelhouse/ into {venv}"


def _quiet() -> dict[str, str]:
    return {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
