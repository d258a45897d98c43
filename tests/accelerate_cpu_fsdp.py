"""Test-only launcher shim: run an accelerate script with FSDP on CPU ranks (gloo).

Usage (what tests/test_examples.py runs)::

    accelerate launch --config_file examples/accelerate/fsdp2.yaml \\
        tests/accelerate_cpu_fsdp.py examples/accelerate/train.py [script args]

Why it is needed: accelerate 1.15 turns ``ACCELERATE_USE_FSDP`` (set by
``accelerate launch`` from an FSDP config) into ``DistributedType.FSDP`` only
when ``PartialState`` found an accelerator backend (``AcceleratorState.__init__``
checks for MULTI_GPU, MULTI_XPU, ...). On a CPU-only machine the process gets
``DistributedType.NO`` (no process group at all), and with ``use_cpu`` it gets
MULTI_CPU, i.e. DDP. Neither runs FSDP.

What it changes, before the script runs: it builds accelerate's
``PartialState`` the CPU way (gloo process group over the ranks that
``accelerate launch`` started, type MULTI_CPU, device plain ``cpu`` through
accelerate's own ``ACCELERATE_TORCH_DEVICE``, because FSDP1 rejects "cpu:0")
and relabels that shared state as MULTI_GPU. When the script's
``Accelerator()`` builds its ``AcceleratorState``, accelerate's own FSDP branch
runs: it reads the FSDP plugin from the environment, sets
``DistributedType.FSDP`` and overwrites the label. The device stays ``cpu``
because ``PartialState`` already chose it. Everything after that is
accelerate's unmodified code: ``prepare`` (its ``fully_shard`` or
``FullyShardedDataParallel`` wrapping from the config), ``backward`` (loss
scaling), ``accumulate``/``no_sync``, ``gather``. The config files are the
ones users run on GPUs, unmodified.

With a DeepSpeed config (zero3.yaml) the same state works: ``AcceleratorState``
turns ``ACCELERATE_USE_DEEPSPEED`` into ``DistributedType.DEEPSPEED``, and
DeepSpeed adopts the gloo process group (``tests/test_deepspeed.py`` runs it).

That the relabel took effect is checked by the example itself (it refuses to
run unless ``accelerator.distributed_type`` is FSDP) and by the tests, which
check the line it prints: FSDP version, device ``cpu``, the wrapped model's
class and its number of FSDP units.
"""

from __future__ import annotations

import os
import runpy
import sys


def _relabel_cpu_state_as_accelerator() -> None:
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available():
        raise SystemExit("accelerate_cpu_fsdp.py is for CPU-only machines; launch the script directly")
    if not any(
        os.environ.get(f"ACCELERATE_USE_{kind}", "false").lower() == "true"
        for kind in ("FSDP", "DEEPSPEED")
    ):
        raise SystemExit(
            "accelerate_cpu_fsdp.py: launch with an FSDP or DeepSpeed config "
            "(no ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED)"
        )
    # accelerate's MULTI_CPU device is "cpu:<local rank>", which FSDP1 rejects
    # against its compute device "cpu"; accelerate's own override picks plain "cpu".
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    state = PartialState(cpu=True)
    if state.distributed_type != DistributedType.MULTI_CPU or state.backend != "gloo":
        raise SystemExit(
            f"accelerate_cpu_fsdp.py: expected a MULTI_CPU gloo state, got "
            f"{state.distributed_type} / {state.backend}"
        )
    # AcceleratorState.__init__ picks FSDP only for accelerator types, then
    # replaces this label with DistributedType.FSDP.
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    _relabel_cpu_state_as_accelerator()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
