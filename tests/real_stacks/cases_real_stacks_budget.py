"""A byte budget under per-layer torch.compile and with peft LoRA (part of
``tests/real_stacks/cases_real_stacks.py``).

``keep_unsharded`` is half the model's unsharded parameter bytes (``HALF``): the
root and the last decoder layer are kept, the other two layers re-gathered in every
pass. Pass 1 is a probe pass (``block.backward(loss, param_grads=False,
retain_graph=True)``), pass 2 the policy loss; ``hf_rl_parity`` checks the
activation gradients the probe pass shows and the gradients and parameters against
the unsharded reference over 3 SGD-momentum steps. A pass that starts by running a
re-gathered unit's pre-backward must still prefetch the next unit; these stacks
change who runs that pre-backward:

- **torch.compile per decoder layer** (as TRL and torchtitan compile HF models):
  FSDP1 FULL_SHARD with ``use_orig_params=True``, each layer compiled in place
  (``layer.compile()``) then wrapped; FSDP2 with ``fully_shard(layer)`` then
  ``layer.compile()`` in place (FSDP2's hooks run inside the compiled region).
  No ``fullgraph``: the activation-gradient hooks break the graph. Two passes over
  one compiled forward need ``torch._functorch.config.donated_buffer = False``
  (see ``tests/real_stacks/cases_compile.py``).
- **peft LoRA** (frozen base and embedding, adapters on q_proj and v_proj), with and
  without non-reentrant checkpointing: FSDP1 FULL_SHARD ``use_orig_params=True``
  (LoRA needs it) and FSDP2.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch.nn as nn
from torch._dynamo.utils import counters

from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.real_stacks_hf import (
    HALF,
    _opt_tag,
    hf_rl_parity,
    lora_qwen2,
    wrap_fsdp1,
    wrap_fsdp2,
    wrap_fsdp2_peft,
)

registry = Registry()
SYNCS = ("every", "last")


def _compiled_fsdp1(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        layer.compile()
    return wrap_fsdp1(model, f1.FULL, True)


def _compiled_fsdp2(model: nn.Module) -> nn.Module:
    model = wrap_fsdp2(model)
    for layer in model.model.layers:
        layer.compile()
    return model


def _compiled_budget_case(wrap, adapter, sync: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    saved = functorch_config.donated_buffer
    functorch_config.donated_buffer = False
    try:
        hf_rl_parity(wrap, adapter, "none", HALF, sync, True)
    finally:
        functorch_config.donated_buffer = saved
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"


for _sync in SYNCS:
    registry.add(
        f"hf_qwen2_compiled_fsdp1_full_orig_{_opt_tag(HALF, _sync)}_probe",
        functools.partial(_compiled_budget_case, _compiled_fsdp1, f1.ADAPTER, _sync),
    )
    registry.add(
        f"hf_qwen2_compiled_fsdp2_{_opt_tag(HALF, _sync)}_probe",
        functools.partial(_compiled_budget_case, _compiled_fsdp2, f2.ADAPTER, _sync),
    )

for _sync, _ckpt in itertools.product(SYNCS, ("none", "nonreentrant")):
    _tag = f"{_opt_tag(HALF, _sync)}{'_ckpt' if _ckpt != 'none' else ''}"
    _wrap = functools.partial(wrap_fsdp1, strategy=f1.FULL, uop=True)
    registry.add(
        f"peft_lora_qwen2_fsdp1_full_orig_{_tag}_probe",
        functools.partial(hf_rl_parity, _wrap, f1.ADAPTER, _ckpt, HALF, _sync, True, lora_qwen2),
    )
    registry.add(
        f"peft_lora_qwen2_fsdp2_{_tag}_probe",
        functools.partial(
            hf_rl_parity, wrap_fsdp2_peft, f2.ADAPTER, _ckpt, HALF, _sync, True, lora_qwen2
        ),
    )
