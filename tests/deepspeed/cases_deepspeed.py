"""DeepSpeed cases (ZeRO-3, and stages 0-2 last), run inside ranks by ``tests/deepspeed/test_deepspeed.py`` (CPU, gloo).

The cases live in parts, one concern each, registered here in this order:

- ``tests/deepspeed/cases_deepspeed_parity.py``: the parity grid; what breaks without the block.
- ``tests/deepspeed/cases_deepspeed_state.py``: refused configurations, the engine's state
  after a clean or failed block.
- ``tests/deepspeed/cases_deepspeed_pass_starts.py``: a first pass from inside the model,
  two forwards in one block, a forward before the block.
- ``tests/deepspeed/cases_deepspeed_api.py``: HF's ``out.loss`` under gradient accumulation,
  HF reentrant gradient checkpointing, a pass from inside the model after the block.
- ``tests/deepspeed/cases_deepspeed_inputs.py``: ``backward(inputs=)`` and ``autograd.grad``
  naming parameters.
- ``tests/deepspeed/cases_deepspeed_loss_grads.py``: per-loss gradients (``block.grads``).
- ``tests/deepspeed/cases_deepspeed_nested.py``: backward passes inside a backward (a tiled MLP,
  a cached loss).
- ``tests/deepspeed/cases_deepspeed_zero12.py``: ZeRO stages 0, 1 and 2 (their own block).
- ``tests/deepspeed/cases_deepspeed_zero12_nested.py``: ZeRO stages 0, 1 and 2 with a tiled MLP.
- ``tests/deepspeed/cases_deepspeed_seams.py``: who steps and who scales, every way in (a plain
  loop, accelerate, the Trainer) x ZeRO-0..3 x every entry, plain DeepSpeed beside it.

``tests/deepspeed/cases_deepspeed_common.py`` holds what they share (the model, the engine, the
reference, ``Scenario`` and ``run_parity``, collective counting).
"""

from tests.deepspeed import (
    cases_deepspeed_api,
    cases_deepspeed_inputs,
    cases_deepspeed_loss_grads,
    cases_deepspeed_nested,
    cases_deepspeed_parity,
    cases_deepspeed_pass_starts,
    cases_deepspeed_seams,
    cases_deepspeed_state,
    cases_deepspeed_zero12,
    cases_deepspeed_zero12_nested,
)
from tests.support.case_parts import combined

registry = combined(
    cases_deepspeed_parity,
    cases_deepspeed_state,
    cases_deepspeed_pass_starts,
    cases_deepspeed_api,
    cases_deepspeed_inputs,
    cases_deepspeed_loss_grads,
    cases_deepspeed_nested,
    cases_deepspeed_zero12,
    cases_deepspeed_zero12_nested,
    cases_deepspeed_seams,
)
