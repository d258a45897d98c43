"""Which API put DDP's reducer on a model: ``DistributedDataParallel`` or the composable
``replicate``. Part of the DDP backend with ``_block.py`` and ``_buckets.py`` (private
DDP access; the composable registry is read here too).

[Note: composable replicate]
``torch.distributed._composable.replicate.replicate(model)`` (torchtitan's
``apply_ddp``, OLMo-core's ``Transformer.apply_ddp``) keeps the user's module, changes
its class to ``DDP<Name>`` and attaches a ``_ReplicateState``. At the first forward
(``lazy_init``) the state builds a ``DistributedDataParallel`` over a ``ParameterList``
of the module's parameters (``state._ddp``): DDP's reducer, buckets and comm hook (the
ones ``model.register_comm_hook`` queued). Forward hooks on the module run DDP's
``_pre_forward`` / ``_post_forward`` around its own forward, and the pre-hook sets
``_ddp.require_backward_grad_sync = not state._no_sync`` at every forward:
``model.set_requires_gradient_sync(False)`` (replicate's ``no_sync()``) sets
``_no_sync``. So the block drives the same reducer as with ``DistributedDataParallel``;
``DDPModel`` hides the three differences: the DDP instance is not the model, the module
whose forward runs is the model itself, and gradient sync is turned off through
``_no_sync`` (the DDP flag alone is overwritten at the next forward). DDP does not exist
before the lazy init, so the block installs at the first forward, after it, as on
FSDP's lazy root.

``replicate_with_fsdp.replicate`` (FSDP2's machinery, a ``ReplicateModule``) is an FSDP2
module and goes to the FSDP2 backend; its registry entry is also named ``replicate``, so
this one is told apart by its state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from .._common import require_attr
from ._buckets import FLAVOUR


@dataclasses.dataclass(frozen=True)
class DDPModel:
    """A model whose gradients DDP's reducer averages, as the block drives it; made by
    ``ddp_model``. See [Note: composable replicate]."""

    model: nn.Module  # what the user passes
    module: nn.Module  # whose forward runs: DDP's .module; replicate: the model itself
    state: Any = None  # replicate's _ReplicateState; None for DistributedDataParallel

    @property
    def initialized(self) -> bool:
        """Whether the DDP instance exists (replicate builds it at the first forward)."""
        if self.state is None:
            return True
        # replicate's own test in its forward pre-hook.
        return not (self.state._init_args or self.state._init_kwargs)

    def init(self) -> None:
        """replicate's lazy init, as its first forward runs it; nothing once done."""
        if not self.initialized:
            require_attr(self.state, "lazy_init", FLAVOUR)()

    @property
    def ddp(self) -> Any:
        """The ``DistributedDataParallel`` that owns the reducer."""
        if self.state is None:
            return self.model
        return require_attr(self.state, "_ddp", FLAVOUR)

    def syncs(self) -> bool:
        """Whether the next forward arms the reducer: false inside ``no_sync()`` or after
        ``set_requires_gradient_sync(False)``."""
        if self.state is None:
            return bool(require_attr(self.model, "require_backward_grad_sync", FLAVOUR))
        return not require_attr(self.state, "_no_sync", FLAVOUR)

    def sync_off(self) -> list[tuple[Any, str, Any]]:
        """``(object, attribute, value)``: what to set while the block runs so that no
        forward arms the reducer (the block restores each in ``finally``)."""
        flags: list[tuple[Any, str, Any]] = [(self.ddp, "require_backward_grad_sync", False)]
        if self.state is not None:
            flags.insert(0, (self.state, "_no_sync", True))
        return flags


def ddp_model(module: nn.Module) -> DDPModel | None:
    """The ``DDPModel`` of a ``DistributedDataParallel`` or of a module ``replicate``
    was applied to; ``None`` for any other module."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return DDPModel(module, module.module)
    state = _replicate_state(module)
    if state is None:
        return None
    return DDPModel(module, module, state)


def _replicate_state(module: nn.Module) -> Any:
    """replicate's ``_ReplicateState`` on ``module``, or ``None``."""
    if "replicate" not in composable_apis(module):
        return None
    try:
        from torch.distributed._composable.replicate import replicate
    except ImportError:
        return None  # no DDP-based replicate: the entry is replicate_with_fsdp's
    # None for replicate_with_fsdp's entry of the same name (its state is FSDP2's).
    state = replicate.state(module)
    if state is not None:
        for name in ("_no_sync", "_init_args", "_init_kwargs"):
            require_attr(state, name, FLAVOUR)
    return state


def fully_sharded_inside(wrapped: DDPModel) -> list[str]:
    """Names of the submodules ``fully_shard`` manages under a replicate model (replicate
    leaves their parameters to FSDP2)."""
    if wrapped.state is None:
        return []
    return [name for name, sub in wrapped.module.named_modules()
            if sub is not wrapped.module and "fully_shard" in composable_apis(sub)]


def composable_apis(module: nn.Module) -> list[str]:
    """The composable APIs applied to ``module`` (``fully_shard``, ``replicate``,
    ``checkpoint``, ...), from torch's composable registry; none for a plain module."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return []
    return list(_get_registry(module) or ())


def composable_states(module: nn.Module) -> list[str]:
    """``"name (StateClass)"`` for each composable API applied to ``module``, for
    messages: what is attached to a module the block does not take."""
    try:
        from torch.distributed._composable.contract import STATE_KEY
    except ImportError:
        return composable_apis(module)
    states = module.__dict__.get(STATE_KEY, {})
    classes = {getattr(api, "__name__", ""): type(state).__name__
               for api, state in (states.items() if isinstance(states, dict) else ())}
    return [f"{name} ({classes[name]})" if name in classes else name
            for name in composable_apis(module)]
