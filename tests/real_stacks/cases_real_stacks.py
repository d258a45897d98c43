"""Configurations from real training stacks (CPU, gloo): each case names its stack.

Run inside ranks by ``tests/real_stacks/test_real_stacks.py``. Grow this module: every
configuration users run that the rest of the suite did not cover gets a case
in one of its parts, with the stack in its name and docstring.

- **HF reentrant gradient checkpointing** (``Qwen2ForCausalLM`` with
  ``gradient_checkpointing_enable({"use_reentrant": True})`` and
  ``enable_input_require_grads()``, as RL and fine-tuning stacks ran it for
  years), and non-reentrant for comparison: FSDP1 FULL_SHARD and
  SHARD_GRAD_OP (world size 2) and HYBRID_SHARD (world size 4), both
  ``use_orig_params``, one unit per ``Qwen2DecoderLayer`` plus the root; FSDP2
  the same way. The RL step: ``-logp.mean()`` backward, ``p.grad = None``,
  then a position-weighted log-prob loss; or pass 1 as a probe pass, whose
  activation hooks must see the reference's gradients. Every option, also
  ``keep_unsharded`` as a byte budget (half the model: the root and the last
  layer kept, two layers re-gathered per pass). peft LoRA and a frozen
  embedding: probe passes reach every layer.
- **torch.utils.checkpoint(..., use_reentrant=True)** inside each unit and
  around each FSDP1 unit.
- **A forward before the block** (``out = model(x)`` above the ``with``):
  FSDP1 refuses the pass before any gradient moves and stays usable; FSDP2
  is right.
- **The FSDP1 guards** (see ``[Note: what the FSDP1 guards check]``): a unit
  whose reduction hook is gone raises instead of leaving an unreduced
  gradient.
- **Hooks for one pass** (bergson-style collectors reading ``block.probing``).
- **A byte budget under per-block torch.compile and with peft LoRA**: some units
  kept, the others re-gathered, after a probe pass.
- **DDP** (what HF Trainer and accelerate set up by default): HF Qwen2 with every
  kind of checkpointing, ``static_graph`` and ``find_unused_parameters``, peft LoRA.
- **A tiled MLP** (the patch axolotl and Liger-Kernel apply to a decoder's MLP: a
  backward per sequence tile inside the MLP's backward) in HF Qwen2 on FSDP2, FSDP1
  (both ``use_orig_params``) and DDP, with and without non-reentrant checkpointing: a
  probe pass through the tiles, then real passes; peft LoRA with adapters in the MLP;
  plain DDP raises, or with ``static_graph`` is wrong.

Parity is against an unsharded reference (deep copy before wrapping, the
same checkpointing, gradients averaged over ranks) over 3 SGD-momentum steps.

The parts, registered here in this order: ``tests/real_stacks/cases_real_stacks_hf.py`` (HF
Qwen2, LoRA, frozen embedding), ``tests/real_stacks/cases_real_stacks_reentrant.py``
(``torch.utils.checkpoint``), ``tests/real_stacks/cases_real_stacks_guards.py`` (a forward
before the block, the FSDP1 guards), ``tests/real_stacks/cases_real_stacks_hooks.py`` (hooks
for one pass), ``tests/real_stacks/cases_real_stacks_budget.py`` (a byte budget under
torch.compile and with LoRA), ``tests/real_stacks/cases_real_stacks_wrappers.py`` (the block
where trainers put it), ``tests/real_stacks/cases_real_stacks_ddp.py`` (HF Qwen2 and LoRA on
DDP), ``tests/real_stacks/cases_real_stacks_tiled.py`` (a tiled MLP). The HF model, its wrapping
and the RL parity check are ``tests/support/real_stacks_hf.py``'s.
"""

from tests.real_stacks import (
    cases_real_stacks_budget,
    cases_real_stacks_ddp,
    cases_real_stacks_guards,
    cases_real_stacks_hf,
    cases_real_stacks_hooks,
    cases_real_stacks_reentrant,
    cases_real_stacks_tiled,
    cases_real_stacks_wrappers,
)
from tests.support.case_parts import combined

registry = combined(
    cases_real_stacks_hf,
    cases_real_stacks_reentrant,
    cases_real_stacks_guards,
    cases_real_stacks_hooks,
    cases_real_stacks_budget,
    cases_real_stacks_wrappers,
    cases_real_stacks_ddp,
    cases_real_stacks_tiled,
)
