"""CPU only: let accelerate's own FSDP (or DeepSpeed) setup run on CPU ranks (gloo).

accelerate sets up FSDP only on accelerator backends: on a CPU-only machine it silently
falls back to independent processes (or, with ``use_cpu``, to DDP). This file makes the
examples run on CPU from a clone, two ways; drop it on GPUs.

As a launcher, for a script that builds its own ``Accelerator`` (examples/accelerate/)::

    accelerate launch --config_file examples/accelerate/fsdp2.yaml \\
        examples/accelerate_cpu_fsdp.py examples/accelerate/train.py [script args]

As a function, for ``transformers.Trainer`` (examples/hf_trainer.py): call
``cpu_state_as_accelerator()`` before ``TrainingArguments`` and pass
``accelerator_config={"use_configured_state": True}`` so that the Trainer keeps it.

Why: accelerate 1.15 turns ``ACCELERATE_USE_FSDP`` (set by ``accelerate launch`` from an
FSDP config) or an FSDP plugin (the Trainer's ``fsdp`` arguments) into
``DistributedType.FSDP`` only when ``PartialState`` found an accelerator backend
(``AcceleratorState.__init__`` checks for MULTI_GPU, MULTI_XPU, ...). On a CPU-only
machine the process gets ``DistributedType.NO`` (no process group at all), and with
``use_cpu`` it gets MULTI_CPU, i.e. DDP. Neither runs FSDP.

What it changes: it builds accelerate's ``PartialState`` the CPU way (gloo process group
over the ranks the launcher started, type MULTI_CPU, device plain ``cpu`` through
accelerate's own ``ACCELERATE_TORCH_DEVICE``, because FSDP1 rejects "cpu:0") and relabels
that shared state as MULTI_GPU. When ``Accelerator()`` builds its ``AcceleratorState``,
accelerate's own FSDP branch runs: it takes the FSDP plugin, sets
``DistributedType.FSDP`` and overwrites the label. The device stays ``cpu`` because
``PartialState`` already chose it. Everything after that is accelerate's unmodified code:
``prepare`` (its ``fully_shard`` or ``FullyShardedDataParallel`` wrapping), ``backward``,
``accumulate``/``no_sync``, ``gather``. The config files are the ones used on GPUs.

With a DeepSpeed config (zero3.yaml) the same state works: ``AcceleratorState`` turns
``ACCELERATE_USE_DEEPSPEED`` into ``DistributedType.DEEPSPEED``, and DeepSpeed adopts the
gloo process group (``tests/deepspeed/test_deepspeed.py`` runs it).

That the relabel took effect is checked by the examples themselves (they refuse to run
unless ``accelerator.distributed_type`` is FSDP or DeepSpeed) and by
``tests/docs/test_examples.py``, which checks the line they print: FSDP version, device
``cpu``, the wrapped model's class and its number of FSDP units.
"""

from __future__ import annotations

import os
import runpy
import sys


def cpu_state_as_accelerator(deepspeed: bool = False) -> None:
    """Builds accelerate's shared ``PartialState`` on CPU (gloo) labelled MULTI_GPU, so that
    the next ``Accelerator`` with an FSDP plugin (or DeepSpeed) sets up FSDP (DeepSpeed).
    ``deepspeed``: labelled DEEPSPEED instead, which ``TrainingArguments(deepspeed=...)``
    requires of a configured state (``use_configured_state``)."""
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available():
        raise SystemExit("accelerate_cpu_fsdp.py is for CPU-only machines; leave it out on GPUs")
    # accelerate's MULTI_CPU device is "cpu:<local rank>", which FSDP1 rejects
    # against its compute device "cpu"; accelerate's own override picks plain "cpu".
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    state = PartialState(cpu=True)
    if state.distributed_type != DistributedType.MULTI_CPU or state.backend != "gloo":
        raise SystemExit(
            f"accelerate_cpu_fsdp.py: expected a MULTI_CPU gloo state over several processes, "
            f"got {state.distributed_type} / {state.backend} (launch 2 or more processes)"
        )
    # AcceleratorState.__init__ picks FSDP only for accelerator types, then
    # replaces this label with DistributedType.FSDP.
    PartialState._shared_state["distributed_type"] = (
        DistributedType.DEEPSPEED if deepspeed else DistributedType.MULTI_GPU)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if not any(
        os.environ.get(f"ACCELERATE_USE_{kind}", "false").lower() == "true"
        for kind in ("FSDP", "DEEPSPEED")
    ):
        raise SystemExit(
            "accelerate_cpu_fsdp.py: launch with an FSDP or DeepSpeed config "
            "(no ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED)"
        )
    cpu_state_as_accelerator()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
