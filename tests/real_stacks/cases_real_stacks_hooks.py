"""Hooks for one pass, as bergson's collectors register them (part of
``tests/real_stacks/cases_real_stacks.py``): full backward hooks read ``block.pass_index`` and
``block.probing`` and collect the probe pass's gradients only; FSDP1 and FSDP2.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import batch, make_net, reference_copy
from tests.support.real_stacks_hf import TOL

registry = Registry()


# --- Hooks for one pass (bergson-style collectors) -----------------------------


def _one_pass_hooks(backend: str) -> None:
    """A collector's full backward hooks on every Linear (as bergson registers them)
    see ``block.pass_index`` and ``block.probing``: a probe pass then two normal
    passes read (1, True), (2, False), (3, False), and a hook that acts only while
    probing collects exactly the probe pass's gradients."""
    model = make_net()
    ref = reference_copy(model)
    model = f2.wrap(model) if backend == "fsdp2" else f1.wrap(model, use_orig_params=True)
    seen: list[tuple[int, bool]] = []
    collected: dict[str, torch.Tensor] = {}
    block_box: list = []

    def collector(name, module, grad_input, grad_output):
        block = block_box[0]
        seen.append((block.pass_index, block.probing))
        if block.probing:  # the one-pass pattern
            assert name not in collected, f"{name} collected twice"
            collected[name] = grad_output[0].detach().clone()

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and "blocks" in name:
            module.register_full_backward_hook(functools.partial(collector, name))
    x = batch(0)
    with no_reshard_between_backwards(model) as block:
        block_box.append(block)
        assert block.pass_index == 0 and not block.probing
        out = model(x)
        block.backward(out.pow(2).mean(), param_grads=False, retain_graph=True)
        assert block.pass_index == 1
        out.mean().backward(retain_graph=True)
        out.pow(2).mean().backward()
    assert sorted(set(seen)) == [(1, True), (2, False), (3, False)], sorted(set(seen))
    assert len(collected) == 6, sorted(collected)
    ref_grads: dict[str, torch.Tensor] = {}
    for name, module in ref.named_modules():
        if isinstance(module, nn.Linear) and "blocks" in name:
            module.register_full_backward_hook(
                lambda m, gi, go, name=name: ref_grads.update({name: go[0].detach().clone()})
            )
    ref(x).pow(2).mean().backward()
    for name, grad in collected.items():
        clean = name.replace("_fsdp_wrapped_module.", "")
        torch.testing.assert_close(grad, ref_grads[clean], **TOL)


for _backend in ("fsdp1", "fsdp2"):
    registry.add(f"one_pass_hooks_{_backend}", functools.partial(_one_pass_hooks, _backend))
