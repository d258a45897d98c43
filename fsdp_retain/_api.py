"""The public context manager and the choice of backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from ._common import ACTIVE_ATTR, RetainOptions, first_wrapped_submodule


def fsdp_flavour(module: nn.Module) -> str | None:
    """``"fsdp1"``, ``"fsdp2"`` or ``None`` for a module that FSDP does not manage."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        return "fsdp1"
    from ._fsdp2 import is_fsdp2_module

    if is_fsdp2_module(module):
        return "fsdp2"
    return None


def _make_block(model: nn.Module, options: RetainOptions):
    from ._deepspeed import is_deepspeed_engine

    if is_deepspeed_engine(model):
        _check_not_active(model)
        from ._deepspeed import DeepSpeedBlock

        return DeepSpeedBlock(model, options)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"no_reshard_between_backwards expects the FSDP root nn.Module, got "
            f"{type(model).__name__}"
        )
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "no_reshard_between_backwards got a DistributedDataParallel model. DDP "
            "all-reduces gradients only in the first backward after a forward; later "
            "backward passes over a retained graph are never all-reduced, so gradients "
            "would be silently wrong (pytorch/pytorch#47260). Wrap the model with "
            "fully_shard(...) or FullyShardedDataParallel(...) instead."
        )
    flavour = fsdp_flavour(model)
    if flavour is None:
        inner = first_wrapped_submodule(model, lambda m: fsdp_flavour(m) is not None)
        if inner is not None:
            raise ValueError(
                f"no_reshard_between_backwards got a {type(model).__name__} that is not "
                f"FSDP-wrapped itself but contains FSDP unit {inner!r}. Wrap the root too "
                "(fully_shard(model) or FullyShardedDataParallel(model)) and pass it."
            )
        raise ValueError(
            f"no_reshard_between_backwards got a {type(model).__name__} that is not "
            "wrapped by FSDP: wrap it with fully_shard(...) or "
            "FullyShardedDataParallel(...) and pass the root module (with DeepSpeed "
            "ZeRO-3, pass the engine deepspeed.initialize returns)."
        )
    _check_not_active(model)
    if flavour == "fsdp2":
        from ._fsdp2 import FSDP2Block

        return FSDP2Block(model, options)
    from ._fsdp1 import FSDP1Block

    return FSDP1Block(model, options)


def _check_not_active(model: nn.Module) -> None:
    if getattr(model, ACTIVE_ATTR, False):
        raise ValueError(
            "no_reshard_between_backwards is already active on this model: nested "
            "blocks on one model are not supported. Use a single block around the "
            "forward and all of its backward passes."
        )


@contextlib.contextmanager
def no_reshard_between_backwards(
    model: nn.Module,
    *,
    keep_unsharded: bool | int = True,
    sync_grads: str = "every",
    backwards: int | None = None,
    check_saved_tensors: bool = False,
) -> Iterator[object]:
    """Run one forward and several backward passes over its retained graph under FSDP.

    Inside the block FSDP does not free the unsharded parameters a retained
    autograd graph still needs (see ``[Note: why a retained graph needs
    unsharded storage]`` in ``fsdp_retain/_common.py``). When the block exits,
    also by an exception, every unit is resharded and every FSDP flag the
    block changed is restored.

    Args:
        model: the root FSDP module: ``FullyShardedDataParallel(...)`` (FSDP1) or
            the module ``fully_shard`` was applied to last (FSDP2); or the
            ``DeepSpeedEngine`` that ``deepspeed.initialize`` returns (ZeRO
            stage 3, see the README).
        keep_unsharded: ``True`` keeps each unit's unsharded parameters from the
            forward through the last backward, so no backward all-gathers
            (memory: the unsharded parameters of all units). ``False`` re-gathers
            per unit in every backward and frees right after (no extra memory,
            one all-gather per unit per backward). An ``int`` is a per-rank byte
            budget for unsharded parameters held between passes: going through
            the units in backward order (the root, then the last layers first),
            the block keeps each one whose unsharded parameter bytes still fit,
            and re-gathers the others per pass (prefetched as in a plain
            backward). ``0`` behaves as ``False``; a budget of all units' bytes as
            ``True``. Only parameters count: with ``sync_grads="last"`` every
            unit also holds its unsharded gradients until the last pass,
            whatever the budget. FSDP1 and FSDP2 only.
        sync_grads: ``"every"`` reduce-scatters after every backward, so ``.grad``
            of the sharded parameters is readable and ``zero_grad()`` works
            between passes. ``"last"`` accumulates unsharded gradients and
            reduce-scatters once, after the last backward (or at block exit);
            ``.grad`` is not updated between passes, ``zero_grad()`` still
            discards earlier passes.
        backwards: the number of backward passes, if known. The last pass then
            reshards each unit as soon as its gradients are done (lower peak).
            With ``None`` everything is resharded when the block exits.
        check_saved_tensors: ``True`` fingerprints every tensor the graph
            saves for backward inside the block and raises a ``RuntimeError``
            naming the autograd node and the tensor's shape when a backward
            pass reads one whose values changed (a backward kernel that writes
            into its saved input, such as flash-attn's
            ``cross_entropy_loss(..., inplace_backward=True)``, or a freed
            storage) instead of computing silently wrong gradients. Tensors
            saved inside a non-reentrant activation-checkpointed region are
            not seen (they are recomputed per pass). Costs a strided sample and
            a sum of each saved tensor when it is saved and when a later pass
            reuses it; see the README.

    On an exception inside the block nothing is communicated: parameters are
    resharded locally and gradients that were not yet reduced are dropped.

    The object bound by ``as`` has ``backward_passes`` (passes seen so far,
    probe passes included) and ``backward(loss, *, param_grads=True,
    retain_graph=None)``: with ``param_grads=False`` a probe pass that only
    feeds hooks on activations, computes no parameter gradients, leaves every
    gradient (also those held unreduced) as it is and reduces nothing (see
    ``[Note: probe passes]`` in ``fsdp_retain/_common.py``). ``backwards``
    counts probe passes too.

    Example::

        with no_reshard_between_backwards(model):
            out = model(batch)
            logp_loss(out).backward(retain_graph=True)
            optimizer.zero_grad()
            policy_loss(out).backward()
        optimizer.step()

        # Backward 1 only for its activation hooks, accumulating over micro-batches:
        with maybe_no_sync(model), no_reshard_between_backwards(model) as block:
            out = model(micro_batch)
            block.backward(logp_loss(out), param_grads=False, retain_graph=True)
            policy_loss(out).backward()
    """
    options = RetainOptions(
        keep_unsharded=keep_unsharded,
        sync_grads=sync_grads,
        backwards=backwards,
        check_saved_tensors=check_saved_tensors,
    )
    block = _make_block(model, options)
    block.enter()
    try:
        yield block
    except BaseException as exc:
        block.exit(exc)
        raise
    block.exit(None)
