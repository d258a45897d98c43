"""The GPU kit's compile cases (``scripts/gpu_validate.py``, stage ``compile``; run inside
ranks, NCCL on one GPU each, ``--dry-run``: CPU, gloo): FSDP2 with each block compiled in
place before ``fully_shard``, as torchtitan does (Inductor on CUDA, which writes Triton
kernels; ``aot_eager`` on CPU, where Inductor would write C++ instead and the dry run only
checks the kit), in the block, against the unsharded reference of
``tests/support/parity.py``: 3 passes over one forward, 3 SGD-momentum steps,
``sync_grads`` "every" and "last". Registered for world sizes 1 to 8.
"""

from __future__ import annotations

import torch

from tests.repo.cases_device import PASSES, WORLD_SIZES
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import Scenario, block_options, device, make_net, reference_copy, run_parity

registry = Registry()


def _compiled_case(sync: str):
    def run() -> None:
        import torch._functorch.config as functorch_config

        saved = functorch_config.donated_buffer
        functorch_config.donated_buffer = False  # two passes over a compiled forward
        try:
            torch._dynamo.reset()
            model = make_net()
            ref = reference_copy(model)
            backend = "inductor" if device().type == "cuda" else "aot_eager"
            for blk in model.blocks:
                blk.compile(backend=backend)
            model = f2.wrap(model)
            scenario = Scenario(passes=PASSES, options=block_options(True, sync, PASSES),
                                check_between=sync == "every")
            run_parity(model, ref, scenario, f2.ADAPTER)
        finally:
            functorch_config.donated_buffer = saved

    return run



for _sync in ("every", "last"):
    registry.add(f"fsdp2_compiled_blocks_{_sync}", _compiled_case(_sync), world_sizes=WORLD_SIZES)
