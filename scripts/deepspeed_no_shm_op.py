"""CI's DeepSpeed venv only (scripts/venv_ci.sh copies this file into it, with a ``.pth``
line that imports it as every Python process of that venv starts): DeepSpeed's CPU
shared-memory all-reduce op is not built.

[Note: CI's DeepSpeed venv builds no shm op]
DeepSpeed's ``TorchBackend`` builds ``deepspeed_shm_comm`` with g++ at the first
``init_distributed`` of a CPU process whenever ``deepspeed.ops.__compatible_ops__`` lists it
(always on Linux): 85 CPU-s in CI, two compilers beside the tests, while the first launch's
ranks wait. The op serves ``inference_all_reduce`` alone (AutoTP inference); every
collective the tests' training steps issue goes through ``torch.distributed`` (gloo)
either way. So the op is marked incompatible in ``deepspeed.ops`` as it is imported, as
DeepSpeed's own comment invites ("edits to it persist"), and ``build_shm_op`` returns
None. ``tests/deepspeed/test_deepspeed.py::test_ci_venv_builds_no_shm_op`` checks that it
took. Nothing here imports deepspeed: the hook waits for the program to.
"""

from __future__ import annotations

import importlib.machinery
import sys

OP = "deepspeed_shm_comm"


def _unmark(ops) -> None:
    compatible = ops.__dict__.get("__compatible_ops__")
    if compatible is not None:  # probed as deepspeed.ops was imported
        compatible[OP] = False
        return
    probe = ops.__dict__.get("__getattr__")  # 0.19: probed on first access, then cached
    if probe is None:
        return

    def __getattr__(name: str):
        value = probe(name)
        if name == "__compatible_ops__":
            value[OP] = False
        return value

    ops.__getattr__ = __getattr__


class _WhenDeepSpeedOpsImports:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname != "deepspeed.ops":
            return None
        sys.meta_path.remove(_WhenDeepSpeedOpsImports)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_unmark(module) -> None:
            exec_module(module)
            _unmark(module)

        spec.loader.exec_module = exec_then_unmark  # type: ignore[method-assign]
        return spec


if _WhenDeepSpeedOpsImports not in sys.meta_path:
    sys.meta_path.insert(0, _WhenDeepSpeedOpsImports)
