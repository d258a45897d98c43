"""FSDP1 (``FullyShardedDataParallel``) backend: the mechanics of a block on FSDP1.

Private FSDP1 access lives here and in the modules beside it: ``_fsdp1_compat``
(the FSDP1 internals, checked at install), ``_fsdp1_units`` (one record per
unit, filled by forward hooks), ``_fsdp1_grads`` (the gradients the block
holds or puts back), ``_fsdp1_loss_grads`` (the gradients as ``block.grads``
sees them), ``_fsdp1_guards`` (invariant checks) and
``_fsdp1_inspect`` (readers for tests and the report, never called by the
block).

See [Note: why a retained graph needs unsharded storage] in ``_common.py``.

What the block does to FSDP1, per ``FlatParamHandle`` (one per unit):

- Every reshard goes through ``_should_free``, the block's version of FSDP's
  ``_should_free_in_backward``: with ``keep_unsharded=True`` no unsharded flat
  parameter is freed (neither after forward nor after backward) until the
  last known pass or the block exit, so the forward's all-gather serves every
  backward. With ``keep_unsharded=False`` every pass frees, as FSDP does. A
  byte budget (``keep_unsharded=<int>``) keeps the units ``Policy.kept`` in
  ``_policy.py`` picks and frees the others per pass (FSDP1's backward
  prefetch re-gathers them ahead, from the forward order the pass end replays).
- After each pass (FSDP's root final callback has run) the block undoes what
  that callback assumes about "the" backward: it re-registers the post-backward
  hook on each ``AccumulateGrad`` (so later passes reduce gradients), and for
  units whose storage was freed it sets ``_needs_pre_backward_unshard`` again,
  puts back the forward's views ``FlatParameter._tensors`` that
  ``use_orig_params=True`` re-points in the pre-backward unshard, and the
  forward order FSDP uses for backward prefetching.
- ``sync_grads="last"`` runs the passes under ``_sync_gradients=False``, FSDP1's
  ``no_sync()`` state: unsharded gradients accumulate locally and are reduced
  by the last known pass, or at block exit by FSDP's own post-backward hook
  and final callback. Between passes ``.grad`` holds these local gradients, as
  in ``no_sync()``; a ``zero_grad()`` between passes is applied to them and to
  the gradients FSDP holds aside from before the block (``watch_zero_grad``).
- ``create_graph=True`` backwards need ``keep_unsharded=True`` (refused
  otherwise); FSDP1's hooks work under it as long as nothing is re-gathered.
- Probe passes (see [Note: probe passes] in ``_common.py``) run under
  ``_sync_gradients=False``. The post-backward hooks on ``AccumulateGrad`` do
  not fire, so a gradient hook on each unit's input reshards the unit when
  its backward is done (``keep_unsharded=False``, or the last known pass),
  and what FSDP's pre-backward moved aside (a reduced ``.grad`` into
  ``_saved_grad_shard``) is put back when the pass ends.

Pass boundaries (see [Note: the block lifecycle] in ``_lifecycle.py``):
``_pass_start`` runs ``on_backward_start`` before the first node of every
backward. If the pass reaches this model, the block queues
FSDP's root final callback (unless FSDP's root pre-backward hook already did)
and then its own, which the engine runs after FSDP's. A pass may start from
any tensor of the forward, so FSDP's pre-backward hooks on unit outputs may
run late (a ``create_graph=True`` gradient graph reaches parameters first) or
never (an activation inside a unit). The block therefore does a unit's
pre-backward work itself at the pass start (``pre_backward`` in
``_fsdp1_mechanics``): with
``keep_unsharded=True`` for every unit whose gradients the pass accumulates;
with ``False`` for units the pass uses but whose outputs it never reaches
(all-gathering them then). Units whose pre-backward ran but that accumulate
nothing in the pass (``autograd.grad``, probe passes) get back the gradients
FSDP's pre-backward moved aside, which its final callback would drop. With
``backwards=N`` and ``sync_grads="last"``, units the last pass does not reach
are reduced at the block exit.

Graphs outlive the block: see ``Liveness`` in ``_common.py`` (its message here is
``AFTER_EXIT`` in ``_guards.py``).
Several forwards with parameter mixed precision: see ``_fsdp1_units``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn as nn

from .. import _pass_start
from .._common import (
    Liveness,
    RetainError,
    compiling,
    grad_tensors,
    is_compiled_in_place,
    loud,
    queue_callback,
    require_attr,
)
from ._compat import FLAVOUR, check_installable, internals
from ._grads import GradLedger
from ._loss_grads import FlatGradSlots
from ._nested import FSDP1Span
from ._inputs import ParamIndex
from ._mechanics import (
    SyncFlags,
    open_inside_root_forward,
    pre_backward,
    probe_reshard,
    rearm,
    reset_iteration,
    reshard,
    reshard_all,
    settle_root_forward,
)
from ._guards import (
    AFTER_EXIT,
    GRADS_OF_GRADS,
    PostBackwardCheck,
    check_not_outside,
    check_sharded_grads,
)
from ._units import ForwardRecorder, Unit, backward_order, make_units
from .._lifecycle import BlockBase
from .._loss_grads import GradSlots
from .._nested import Span
from .._policy import RetainOptions


@loud
def _unit_input_grad(block_ref: Any, unit: Unit, grad: torch.Tensor) -> None:
    # A weak reference: the hook stays on the graph, the block must not.
    block = block_ref()
    if block is not None and block.probing:
        block._probe_unit_done(unit)


PASS_IN_FORWARD = (
    "no_reshard_between_backwards on FSDP1: a backward pass started inside the model's "
    "forward (DeepSpeed's TiledFusedLogitsLoss runs one per shard there). FSDP1 runs its "
    "post-backward reduction and reshard in it while its forward still runs (plain FSDP1 "
    "fails on it too), so it is refused before it writes a gradient. Use FSDP2 "
    "(fully_shard) or DDP for a loss that runs its backward in the forward."
)


class FSDP1Block(BlockBase):
    """One ``no_reshard_between_backwards`` block on an FSDP1 root."""

    def __init__(self, model: nn.Module, options: RetainOptions) -> None:
        super().__init__(model, options)
        self._fsdp = internals()
        if require_attr(model, "_is_root", FLAVOUR) is False:
            raise ValueError(_non_root_message(model))
        if require_attr(model, "cpu_offload", FLAVOUR).offload_params:
            raise ValueError(_NO_OFFLOAD)
        self._hooks: list[Any] = []
        self._states: list[Any] = []  # every FSDP state, also those without parameters
        self._units: list[Unit] = []  # the states with a flat parameter
        self._sync = SyncFlags()  # each state's _sync_gradients
        self._freeing = False  # the last known pass started, or the block exits
        self._pass_open = False
        self._had_sentinels = False
        # See [Note: what the FSDP1 guards check] in _guards.py.
        self._post_backward = PostBackwardCheck()
        self._recorder: ForwardRecorder | None = None
        self._ledger: GradLedger | None = None
        self._lookup = ParamIndex(self._units)  # passes with inputs=

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return self.model._is_root is not None

    def _init_root(self) -> None:
        if self.model._is_root is False:
            raise ValueError(_non_root_message(self.model))
        self._fsdp.lazy_init(self.model, self.model)

    def _install(self) -> None:
        model, policy = self.model, self.policy
        self._states = list(require_attr(model, "_all_fsdp_states", FLAVOUR))
        check_installable(model, self._states)
        self._units.extend(make_units(model, self._states))
        self._sync.save(self._states)
        recorder = self._recorder = ForwardRecorder(
            model, self._units, self._fsdp.post_backward_hook, Liveness(AFTER_EXIT)
        )
        ledger = self._ledger = GradLedger(model, self._units, self._states)
        self._hooks.extend(self._post_backward.install(self._units))
        kept = policy.kept(backward_order(model, self._units))
        for unit in self._units:
            unit.kept = unit in kept
        self._all_kept = len(kept) == len(self._units)
        self._kept_total = len(kept)
        self._installed = True
        self._watch()
        for unit in self._units:
            handle = unit.handle
            handle.reshard = functools.partial(self._reshard, unit, handle.reshard)
            if policy.holds_back:
                original = handle.pre_unshard
                handle.pre_unshard = functools.partial(ledger.pre_unshard, unit, original)
        self._hooks.append(recorder.hook_root())
        open_inside_root_forward(model, self._units, recorder)
        self._hooks.extend(self.probe_targets.hook_sources(model))
        unit_of = {id(u.state): u for u in self._units}
        for state in self._states:
            unit = unit_of.get(id(state))
            self._hooks.append(self.probe_targets.hook_unit(state))
            if unit is not None and unit.handle.uses_sharded_strategy:
                hook = functools.partial(self._hook_unit_inputs, unit)
                self._hooks.append(state.register_forward_pre_hook(hook, with_kwargs=True))
            inner = state._fsdp_wrapped_module
            # No hook inside a compiled region: see [Note: the block under torch.compile].
            inner_eager = not is_compiled_in_place(inner)
            if inner_eager:
                self._hooks.append(inner.register_forward_hook(recorder.guard_outputs))
            if unit is not None:
                self._hooks.extend(recorder.hook_unit(unit, inner_eager))
        if policy.holds_back:
            self._sync.turn_off(self._states)

    def _uninstall(self) -> None:
        if self._recorder is not None:
            self._recorder.alive.exited = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for unit in self._units:
            unit.handle.__dict__.pop("reshard", None)
            unit.handle.__dict__.pop("pre_unshard", None)
        self._sync.restore()
        self._units.clear()
        self._release_model()

    def _finish(self) -> None:
        """Clean exit: reduce what is still unreduced, reshard everything."""
        self._freeing = True
        self.tracker.warn_if_short()
        ledger = self._ledger
        ledger.check_sentinels()
        self._sync.restore()
        # Nothing held back, or the user is inside FSDP's no_sync().
        if self.policy.holds_back and self._sync.user_syncs():
            if ledger.has_unreduced():
                ledger.flush()
        reshard_all(self._units)
        ledger.clear_unnamed()
        self._reset_iteration_state()

    def _abort(self) -> None:
        """Exception exit: no collectives (other ranks may not be here)."""
        self._freeing = True
        pending_local = self.policy.holds_back or self.tracker.in_backward
        self._sync.restore()
        self._reset_iteration_state()
        reshard_all(self._units)
        for unit in self._units:
            self._ledger.drop_unreduced(unit, pending_local)

    # The keep/free decision: see should_free #
    def _reshard(self, unit: Unit, original, free_unsharded_flat_param: bool) -> None:
        reshard(unit, original, free_unsharded_flat_param, pass_open=self._pass_open,
                freeing=self._freeing)

    def _open_span(self) -> Span:
        return FSDP1Span(self._units, self.probing)

    # Called by _pass_start around every backward while installed #
    def before_backward(self) -> None:
        """Outside the engine, before any hook of the pass has moved a gradient."""
        if self._exited or self._pass_open:
            return
        settle_root_forward(self.model, self._recorder)
        ledger = self._ledger
        self._had_sentinels = ledger.has_sentinels()
        ledger.check_sentinels()  # a zero_grad() since the last pass
        ledger.snapshot()
        self._post_backward.begin_pass()

    def _pass_in_forward_refusal(self) -> str | None:
        return PASS_IN_FORWARD

    @loud
    def on_backward_start(self) -> None:
        """Inside the pass, before its first node runs."""
        if self._exited or self._pass_open:
            return
        run = _pass_start.will_run
        check_not_outside(self._units, run)
        uses = [u for u in self._units if u.uses(run)]
        if uses:
            self._check_pass_in_forward()
        if not uses:  # another model's backward
            self._ledger.forget_snapshot()
            if self._had_sentinels:
                # Still watch for a zero_grad() before our next pass.
                self._ledger.watch_zero_grad(self.policy.holds_back and not self._freeing)
            return
        for unit in self._units:
            unit.accumulating = unit in uses and unit.accumulates(run)
        accumulating = [u for u in self._units if u.accumulating]
        if torch.is_grad_enabled() and accumulating and not self.probing:
            raise RetainError(GRADS_OF_GRADS)
        if not self.probing:
            self._ledger.note_selection()
        self._on_pass_start()
        for unit in uses:
            if not unit.handle._ran_pre_backward_hook and unit.runs_early(run):
                pre_backward(unit)
        if self._freeing and self.policy.holds_back and not self.probing:
            # The last pass reduces what it accumulates into; the rest at exit.
            for unit in self._units:
                if not unit.accumulating:
                    unit.state._sync_gradients = False

    @loud
    def _on_pass_start(self) -> None:
        index = self._start_pass()
        self._pass_open = True
        model = self.model
        if not model._post_backward_callback_queued:
            # Checked before FSDP finalizes the pass (when FSDP's root
            # pre-backward hook queued its callback first, only after).
            queue_callback(self._post_backward.check)
            # What FSDP's root pre-backward hook does first, for a pass that
            # does not start at (or never reaches) the root's outputs.
            self._fsdp.register_post_backward_final_callback(model, model)
            self._fsdp.reset_flat_param_grad_info_if_needed([u.handle for u in self._units])
        queue_callback(self._on_pass_end)
        self._ledger.check_sentinels()  # units whose pre-backward has not run yet
        if self.policy.is_last(index):
            self._freeing = True
            if not self.probing:
                self._sync.restore()

    @loud
    def _on_pass_end(self) -> None:
        self._pass_open = False
        self._end_pass()
        # Before _sync_gradients is restored (the last pass of sync_grads="last" reduces).
        reduced = self._post_backward.check_at_pass_end()
        self._end_probe()
        if self.policy.holds_back and self._freeing:
            self._sync.restore()
        rearm(self.model, self._units, self._recorder)
        if not self.policy.holds_back:
            self._ledger.clear_unnamed()
        self._ledger.watch_zero_grad(self.policy.holds_back and not self._freeing)
        check_sharded_grads(reduced)

    # Per-loss gradients: see [Note: per-loss gradients] in _loss_grads.py #
    def _check_grads(self) -> None:
        if not self._sync.user_syncs():
            raise ValueError(_GRADS_NEED_SYNC)

    def _make_grad_slots(self) -> GradSlots:
        return FlatGradSlots.of_units(self.model, self._units)

    # Probe passes #
    def _hook_unit_inputs(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Hooks the unit's inputs: their gradient is complete once the unit's
        backward is done, which in a probe pass is when it can be resharded."""
        if compiling() or not torch.is_grad_enabled() or self._in_backward():
            return
        hook = functools.partial(_unit_input_grad, weakref.ref(self), unit)
        for tensor in grad_tensors((args, kwargs)):
            tensor.register_hook(hook)  # lives as long as the graph

    def _probe_unit_done(self, unit: Unit) -> None:
        if not unit.kept or self._freeing:
            probe_reshard(unit)

    def _before_probe(self) -> None:
        self._sync.begin_probe(self._states)

    def _end_probe(self) -> None:
        self._sync.end_probe()
        if self._ledger is not None:
            self._ledger.restore(self._post_backward.accumulated, self.probing)

    def _reset_iteration_state(self) -> None:
        reset_iteration(self.model, self._states, self._units)
        self._recorder.forget()
        self._ledger.forget_sentinels()


_GRADS_NEED_SYNC = (
    "block.grads() needs each pass reduced: this model is inside FSDP1's no_sync(). "
    "Call it outside gradient accumulation, or leave no_sync() for this micro-batch."
)
_NO_OFFLOAD = (
    "no_reshard_between_backwards does not support FSDP1 with "
    "CPUOffload(offload_params=True): its gradients live in a CPU copy that FSDP1 "
    "only supports for one backward per iteration. Turn parameter offloading off for "
    "this model."
)


def _non_root_message(model: nn.Module) -> str:
    return (
        f"no_reshard_between_backwards got a non-root FSDP1 unit "
        f"({type(model).__name__}): another FullyShardedDataParallel module ran "
        "forward first and became the root. Pass that outermost "
        "FullyShardedDataParallel module, whose forward runs the others."
    )
