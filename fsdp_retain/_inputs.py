"""Passes whose ``inputs`` name the model's parameters: the driver's part.

``BlockBase.map_inputs`` (``_lifecycle.py``) calls ``map_inputs`` here; the
backends answer ``_graph_inputs`` (what stands for a parameter in the graph),
``_param_storages`` and ``_select_grads`` (FSDP1: ``_fsdp1/_inputs.py``).

[Note: inputs that name parameters]
``loss.backward(inputs=params)`` and ``torch.autograd.grad(loss, params)``
name the parameters the user holds: FSDP2's sharded DTensors, FSDP1's
original parameters (views into the sharded flat parameter). The forward's
graph never used those tensors but unsharded ones (FSDP2's unsharded
parameter, FSDP1's flat parameter), so plain FSDP silently computes nothing
for them (``backward``) or zeros (``autograd.grad``). ``_pass_start`` hands
the pass's ``inputs`` to ``map_inputs`` before the engine starts:
- each input the backend maps (``_graph_inputs``: a managed parameter, or the
  ``GradientEdge`` of one) is replaced by what the graph uses (FSDP2's
  unsharded parameter; the ``AccumulateGrad`` nodes FSDP1's forwards made for
  the flat parameter, new per forward under mixed precision), so the
  pass computes, reduces and shards its gradient as a full pass would and
  leaves the other parameters alone (``_select_grads``: FSDP1 keeps one
  gradient per unit, zeroes the parts of its flat gradient that belong to
  parameters the pass did not name, and gives back ``None`` as the ``.grad``
  of those that had none: ``GradLedger.clear_unnamed``);
- ``autograd.grad`` (which returns gradients instead of accumulating them)
  naming a managed parameter is refused before anything runs: the result
  would be zeros or a local, unreduced gradient;
- an input that shares storage with a managed parameter but is not one (a
  slice, ``to_local()``) is refused too: no leaf of the graph stands for it;
- so is ``inputs=`` over a reentrant activation checkpoint, which torch
  refuses only midway through the pass;
- and a backward run inside another one's node (a custom Function's backward:
  torchjd's ``autogram.Engine`` computes its Gramian so) naming a managed
  parameter: its gradients would join the pass around it (see [Note: nested
  backward passes] in ``_nested.py``), not the parameters it names alone; under
  plain FSDP such a Gramian is silently zero.
``BlockBase.after_backward`` drops what ``_select_grads`` put on the graph.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import RetainError
from ._probe import reaches_reentrant_checkpoint


class ParamLookup:
    """A backend's parameters for passes with ``inputs``: what stands for one in the
    graph, their storages, the hooks that restrict a pass to the named ones. This one
    manages none; ``BlockBase._graph_inputs`` and its siblings ask the block's."""

    def graph_inputs(self, tensor: torch.Tensor) -> list[Any] | None:
        return None

    def storages(self) -> set[int]:
        return set()

    def select(self, named: list[torch.Tensor]) -> list[Any]:
        return []

    def forget_selection(self) -> None:
        """After every pass: ``select``'s choice no longer applies."""


def map_inputs(block: Any, inputs: tuple, accumulate: bool, roots: list,
               nested: bool = False) -> tuple[tuple, list]:
    """``(inputs for the engine, the managed parameters named)``; raises before the
    pass for what cannot be right (see the note)."""
    mapped: list[Any] = []
    seen: set[int] = set()
    named: list[torch.Tensor] = []
    storages: set[int] | None = None
    for item in inputs:
        # A GradientEdge of a leaf stands for the leaf (AccumulateGrad.variable).
        tensor = getattr(getattr(item, "node", None), "variable", item)
        graph = block._graph_inputs(tensor) if isinstance(tensor, torch.Tensor) else None
        if graph is not None:
            named.append(tensor)
            for entry in graph:
                key = id(getattr(entry, "node", entry))
                if key not in seen:
                    seen.add(key)
                    mapped.append(entry)
            continue
        if isinstance(tensor, torch.Tensor):
            if storages is None:
                storages = block._param_storages()
            if _storage_ptr(tensor) in storages:
                raise RetainError(_UNMAPPABLE_INPUT.format(_describe(tensor)))
        mapped.append(item)
    if not named:
        return inputs, []
    if not accumulate:
        raise RetainError(_GRAD_OF_PARAMS.format(len(named)))
    if nested:
        raise RetainError(_NESTED_INPUTS.format(len(named)))
    if reaches_reentrant_checkpoint(roots):
        raise ValueError(_INPUTS_OVER_REENTRANT)
    return tuple(mapped), named


def _storage_ptr(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _describe(tensor: torch.Tensor) -> str:
    return f"a {type(tensor).__name__} of shape {tuple(tensor.shape)}"


_GRAD_OF_PARAMS = (
    "torch.autograd.grad(...) inside no_reshard_between_backwards names {} parameter(s) "
    "of the FSDP model. FSDP's forward used unsharded copies of them, so the result "
    "would be zeros (or a local, unreduced gradient), never their gradient. Use "
    "loss.backward(inputs=params, retain_graph=True) (or block.backward(loss, "
    "inputs=params)), which computes, reduces and shards their gradients into .grad; "
    "for one gradient per loss apart from .grad (torchjd's autogram, a Gramian "
    "weighting), block.grads(loss) and fsdp_retain.gramian(grads); take "
    "torch.autograd.grad only with respect to activations."
)
_NESTED_INPUTS = (
    "a backward started inside another backward (from a custom autograd.Function's "
    "backward or a hook) inside no_reshard_between_backwards names {} parameter(s) of "
    "the FSDP model as inputs: the block maps inputs= only for passes outside any "
    "backward (a nested pass's gradients are reduced with the pass around it, see "
    "docs/guide.md#nested-backward-passes). Drop inputs= from the nested backward, or "
    "call loss.backward(inputs=params) (or block.backward(loss, inputs=params)) outside "
    "any backward."
)
_INPUTS_OVER_REENTRANT = (
    "backward(inputs=...) inside no_reshard_between_backwards reaches a reentrant "
    "activation checkpoint (torch.utils.checkpoint with use_reentrant=True), which "
    "refuses inputs= (torch raises midway through the pass, after some gradients were "
    "written). Use non-reentrant checkpointing (checkpoint(..., use_reentrant=False); in "
    "HF transformers model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{'use_reentrant': False})), or drop inputs=. Nothing was changed."
)
_UNMAPPABLE_INPUT = (
    "backward/autograd.grad inputs inside no_reshard_between_backwards include {}, which "
    "shares storage with a parameter of the FSDP model but is not that parameter (a "
    "slice, a view, to_local()): the forward's graph used an unsharded copy, so its "
    "gradient would silently be missing or zero. Name the parameter itself (as "
    "model.parameters() gives it) in inputs=."
)


class PassInputs:
    """The part of ``BlockBase`` that maps the ``inputs`` of a pass (``_pass_start``)."""

    # Set by BlockBase.__init__ (the backend's ParamLookup) and at install.
    _lookup: ParamLookup
    _selection: list[Any]
    _installed: bool
    _exited: bool

    def _graph_inputs(self, tensor: torch.Tensor) -> list[Any] | None:
        """What stands for ``tensor``, a parameter this block manages, in the
        forward's graph (leaves, or ``GradientEdge``s of their ``AccumulateGrad``
        nodes); ``None`` if it manages no such parameter."""
        return self._lookup.graph_inputs(tensor)

    def _param_storages(self) -> set[int]:
        """Data pointers of the managed parameters' storages (unmappable views)."""
        return self._lookup.storages()

    def _select_grads(self, named: list[torch.Tensor]) -> list[Any]:
        """Before a pass whose ``inputs`` name ``named`` (managed parameters):
        graph hooks that keep the pass from writing to the parameters that
        share a leaf with them but are not named; returns their handles."""
        return self._lookup.select(named)

    def map_inputs(self, inputs: tuple, accumulate: bool, roots: list, nested: bool = False) -> tuple:
        """The ``inputs`` of a pass (over the autograd nodes ``roots``), with managed
        parameters replaced by what the graph uses (``_pass_start``)."""
        if not self._installed or self._exited:
            return inputs
        mapped, named = map_inputs(self, inputs, accumulate, roots, nested)
        if named:
            self._selection.extend(self._select_grads(named))
        return mapped
