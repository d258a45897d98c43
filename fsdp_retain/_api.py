"""The public context manager and the choice of backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal, Protocol

import torch
import torch.nn as nn

from ._common import ACTIVE_ATTR, first_wrapped_submodule
from ._lifecycle import BlockBase
from ._loss_grads import LossGrads
from ._policy import RetainOptions
from ._stack import not_wrapped_fix, wrapper_fix

SyncGrads = Literal["every", "last"]


class RetainBlock(Protocol):
    """What ``with no_reshard_between_backwards(model) as block`` binds.

    The same for every backend (FSDP1, FSDP2, DeepSpeed, DDP). Plain
    ``loss.backward(...)`` / ``engine.backward(...)`` calls inside the block are
    backward passes too; ``block.backward`` is needed only for probe passes.

    Attributes:
        backward_passes: the backward passes this block has seen so far (probe
            passes included); read-only.
        pass_index: the 1-based index of the running backward pass (0 before the
            first; between passes, the last one's), for hooks that act in one
            pass: a module's backward hooks fire in every pass over a retained
            graph.
        probing: true while a probe pass (``backward(..., param_grads=False)``)
            runs.

    Example::

        with no_reshard_between_backwards(model) as block:
            out = model(batch)
            block.backward(out.pow(2).mean(), param_grads=False, retain_graph=True)
            out.mean().backward()
        assert block.backward_passes == 2
    """

    @property
    def backward_passes(self) -> int: ...

    @property
    def pass_index(self) -> int: ...

    @property
    def probing(self) -> bool: ...

    def backward(
        self,
        loss: torch.Tensor,
        *,
        param_grads: bool = True,
        retain_graph: bool | None = None,
        inputs: Any = None,
    ) -> None:
        """One backward pass of ``loss``: with ``param_grads=True`` it is
        ``loss.backward(retain_graph=retain_graph, inputs=inputs)`` (``inputs``:
        parameters as ``model.parameters()`` gives them; only their gradients are
        computed, reduced and sharded); with ``False`` a probe pass that only
        feeds hooks on activations (no parameter gradient, no ``.grad`` change,
        nothing reduced; no ``inputs``)."""
        ...


    def grads(self, loss: torch.Tensor, *, retain_graph: bool | None = None,
              params: Any = None) -> LossGrads:
        """One backward pass of ``loss`` whose reduced, sharded gradients come back
        (a ``LossGrads``) instead of adding to ``.grad``: the sharded counterpart of
        ``torch.autograd.grad(loss, model.parameters())`` (FSDP1, FSDP2, ZeRO-3) over
        the trainable parameters, or those ``params`` names (a submodule, parameter
        names, or the wrapped model's parameters; see ``LossGrads.select``)."""
        ...


def wrapper_flavour(module: nn.Module) -> str | None:
    """``"fsdp1"``, ``"fsdp2"`` (also ``replicate_with_fsdp``), ``"ddp"`` (also the
    composable ``replicate``) or ``None`` for a module no wrapper manages."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        return "fsdp1"
    from ._fsdp2 import is_fsdp2_module

    if is_fsdp2_module(module):
        return "fsdp2"
    from ._ddp import ddp_model

    if ddp_model(module) is not None:
        return "ddp"
    return None


def _make_block(model: nn.Module, options: RetainOptions) -> BlockBase:
    from ._deepspeed import is_deepspeed_engine

    if is_deepspeed_engine(model):
        _check_not_active(model)
        from ._deepspeed import DeepSpeedBlock, DeepSpeedZero12Block, zero_stage

        if zero_stage(model) in (0, 1, 2):
            return DeepSpeedZero12Block(model, options)
        options.check_reshard_to("DeepSpeed ZeRO-3")
        return DeepSpeedBlock(model, options)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"no_reshard_between_backwards expects the DDP or FSDP root nn.Module, got "
            f"{type(model).__name__}"
        )
    flavour = wrapper_flavour(model)
    if flavour is None:
        inner = first_wrapped_submodule(model, lambda m: wrapper_flavour(m) is not None)
        if inner is not None:
            model = _root_inside_wrapper(model, inner)
            flavour = wrapper_flavour(model)
    if flavour is None:
        raise ValueError(
            f"no_reshard_between_backwards got a {type(model).__name__} that is not "
            f"wrapped by DDP or FSDP{_composable_found(model)}. {not_wrapped_fix(model)}"
        )
    _check_not_active(model)
    if flavour == "ddp":
        from ._ddp import DDPBlock

        return DDPBlock(model, options)
    if flavour == "fsdp2":
        from ._fsdp2 import FSDP2Block

        return FSDP2Block(model, options)
    from ._fsdp1 import FSDP1Block, shard_groups

    if options.reshard_to is not None:
        # HYBRID_SHARD over groups of reshard_to ranks already re-gathers inside them.
        options.check_reshard_to("FSDP1", shard_groups(model))
    return FSDP1Block(model, options)


def _root_inside_wrapper(model: nn.Module, inner: str) -> nn.Module:
    """The FSDP root inside a wrapper that holds no parameter of its own (a
    LightningModule whose ``configure_model`` sharded ``self.net``, the module Fabric's
    ``setup`` returns); a refusal naming the fix where the wrapper holds more."""
    def is_unit(m: nn.Module) -> bool:
        return wrapper_flavour(m) is not None

    roots = [m for name, m in model.named_modules()
             if m is not model and is_unit(m)
             and not any(is_unit(a) for a in _ancestors(model, name))]
    inside = {id(p) for r in roots for p in r.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in inside]
    if len(roots) == 1 and not outside:
        return roots[0]
    why = (f"{len(roots)} outermost FSDP units" if len(roots) > 1
           else f"parameters outside it ({', '.join(outside[:3])})")
    raise ValueError(
        f"no_reshard_between_backwards got a {type(model).__name__} that is not "
        f"FSDP-wrapped itself but contains FSDP unit {inner!r} and {why}. "
        f"{wrapper_fix(model)}"
    )


def _composable_found(model: nn.Module) -> str:
    """What composable state a refused module carries, if any."""
    from ._ddp import composable_states

    found = composable_states(model)
    if not found:
        return ""
    return (f" (composable APIs on it: {', '.join(found)}; the block takes replicate and "
            "fully_shard, also replicate_with_fsdp's replicate)")


def _ancestors(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """The modules strictly between ``model`` and the submodule ``name``."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield model.get_submodule(".".join(parts[:i]))


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
    sync_grads: SyncGrads = "every",
    backwards: int | None = None,
    check_saved_tensors: bool = False,
    reshard_to: int | None = None,
) -> Iterator[RetainBlock]:
    """Run one forward and several backward passes over its retained graph under FSDP.

    Inside the block FSDP does not free the unsharded parameters a retained
    autograd graph still needs, so every backward pass over the block's
    forward sees them. When the block exits, also by an exception, every unit
    is resharded and every FSDP flag the block changed is restored. How it
    works, per backend: ``docs/guide.md``; the options side by side:
    ``docs/options.md``.

    Args:
        model: the root FSDP module: ``FullyShardedDataParallel(...)`` (FSDP1) or
            the module ``fully_shard`` was applied to last (FSDP2); or the
            ``DeepSpeedEngine`` that ``deepspeed.initialize`` returns (ZeRO
            stages 0-3, ``docs/backends.md``); or a ``DistributedDataParallel``
            model, or the module the composable ``replicate`` was applied to
            (``docs/backends.md#ddp``).
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
            whatever the budget. FSDP1 and FSDP2 only; no effect on DDP
            (nothing is sharded).
        sync_grads: ``"every"`` reduce-scatters after every backward, so ``.grad``
            of the sharded parameters is readable and ``zero_grad()`` works
            between passes. ``"last"`` accumulates unsharded gradients and
            reduce-scatters once, after the last backward (or at block exit);
            ``.grad`` is not updated between passes, ``zero_grad()`` still
            discards earlier passes.
        backwards: the number of backward passes, if known (probe passes
            count). The last pass then reshards each unit as soon as its
            gradients are done (lower peak). With ``None`` everything is
            resharded when the block exits.
        check_saved_tensors: ``True`` fingerprints every tensor the graph
            saves for backward inside the block and raises a ``RuntimeError``
            naming the autograd node and the tensor's shape when a backward
            pass reads one whose values changed (a backward kernel that writes
            into its saved input, such as flash-attn's
            ``cross_entropy_loss(..., inplace_backward=True)``, or a freed
            storage) instead of computing silently wrong gradients. Tensors
            saved inside a non-reentrant activation-checkpointed region are
            not seen (they are recomputed per pass). Costs about 1.1x step
            time; use it to validate a setup.
        reshard_to: between passes, each unit not kept unsharded
            (``keep_unsharded=False`` or a budget) is resharded to groups of
            this many ranks (e.g. the GPUs of one node) instead of every rank
            of its mesh, as ``fully_shard(..., reshard_after_forward=<int>)``
            does after forward, so later passes all-gather inside the group
            only (memory: 1/N of those units' unsharded parameters). ``None``:
            every rank, or the group size the model was built with
            (``reshard_after_forward=<int>``). Must divide the ranks each
            parameter is sharded over. Reduce-scatters are unchanged. FSDP2;
            on FSDP1 only where every unit is ``HYBRID_SHARD`` with a shard group
            of exactly this many ranks, where FSDP1 re-gathers already (the block
            runs as without the option); refused otherwise and on ZeRO-3.

    Yields:
        A ``RetainBlock``: ``block.backward_passes`` (passes seen so far, probe
        passes included) and ``block.backward(loss, *, param_grads=True,
        retain_graph=None)``; with ``param_grads=False`` that is a probe pass
        that only feeds hooks on activations, computes no parameter gradients,
        leaves every gradient (also those held unreduced) as it is and reduces
        nothing.

    On an exception inside the block nothing is communicated: parameters are
    resharded locally and gradients that were not yet reduced are dropped.

    Example::

        # torchrun --nproc_per_node 2 example.py   (CPU, gloo)
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from fsdp_retain import no_reshard_between_backwards

        dist.init_process_group("gloo")
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(4, 8)

        # Two losses, one forward: both passes add to .grad, as two forwards would.
        with no_reshard_between_backwards(model, backwards=2):
            out = model(batch)
            out.pow(2).mean().backward(retain_graph=True)
            optimizer.zero_grad()  # optional: drop the first loss's gradients
            out.mean().backward()
        optimizer.step()

        # Backward 1 only for its hooks on activations (a probe pass).
        seen = []
        with no_reshard_between_backwards(model) as block:
            out = model(batch)
            out.register_hook(lambda grad: seen.append(grad.norm()))
            block.backward(out.pow(2).mean(), param_grads=False, retain_graph=True)
            out.mean().backward()
        optimizer.step()
        print(f"rank {dist.get_rank()}: {block.backward_passes} passes, {len(seen)} hook calls")
        dist.destroy_process_group()
    """
    options = RetainOptions(
        keep_unsharded=keep_unsharded,
        sync_grads=sync_grads,
        backwards=backwards,
        check_saved_tensors=check_saved_tensors,
        reshard_to=reshard_to,
    )
    block = _make_block(model, options)
    block.enter()
    try:
        yield block
    except BaseException as exc:
        block.exit(exc)
        raise
    block.exit(None)
