"""What FSDP1 does per unit that the block runs itself, or undoes after a pass.

Part of the FSDP1 backend with ``_block.py`` (private FSDP1 access). FSDP1's
root final callback assumes each forward has one backward: it drops the
post-backward hooks, the forward order that drives prefetching and, for freed
units, the flag that makes the next pass re-gather. ``rearm`` puts them back
after each pass; ``reset_iteration`` leaves FSDP1 as that callback would at
the block exit; ``pre_backward`` is FSDP1's per-unit pre-backward hook, for a
pass that reaches a unit's parameters before (or without) its outputs;
``should_free`` is the block's version of FSDP's decision to free a unit's
unsharded flat parameter.
"""

from __future__ import annotations

from typing import Any

from ._compat import HOOK_STATE, internals
from ._units import ForwardRecorder, Unit
from .._policy import Policy


class SyncFlags:
    """Each FSDP1 state's ``_sync_gradients``: as the block found it (put back for the
    last pass and at the exit) and as a probe pass found it."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, bool]] = []
        self._probe: list[tuple[Any, bool]] = []

    def save(self, states: list[Any]) -> None:
        self._saved = [(s, s._sync_gradients) for s in states]

    def user_syncs(self) -> bool:
        """The user is not inside FSDP1's ``no_sync()``."""
        return all(value for _, value in self._saved)

    def restore(self) -> None:
        for state, value in self._saved:
            state._sync_gradients = value

    @staticmethod
    def turn_off(states: list[Any]) -> None:
        for state in states:
            state._sync_gradients = False

    def begin_probe(self, states: list[Any]) -> None:
        self._probe = [(s, s._sync_gradients) for s in states]
        self.turn_off(states)

    def end_probe(self) -> None:
        """Idempotent."""
        for state, value in self._probe:
            state._sync_gradients = value
        self._probe = []


def should_free(unit: Unit, fsdp_free: bool, *, pass_open: bool, freeing: bool) -> bool:
    """Whether a reshard of ``unit`` frees its unsharded flat parameter.

    ``fsdp_free`` is FSDP's own answer (``_post_forward_reshard``,
    ``_should_free_in_backward``); ``pass_open``: a pass of the block runs;
    ``freeing``: its last known pass runs, or the block exits. See [Note: why a
    retained graph needs unsharded storage].
    """
    handle = unit.handle
    if not handle.uses_sharded_strategy:
        return False
    phase, states = handle._training_state, internals().HandleTrainingState
    if phase == states.FORWARD:  # post-forward reshard
        return fsdp_free and not unit.kept
    # pass_open: also FSDP's catch-all reshard of units the pass never reached.
    if phase in (states.BACKWARD_PRE, states.BACKWARD_POST) or pass_open:
        return Policy.frees_after_pass(unit.kept, freeing=freeing)
    return fsdp_free  # summon_full_params and the like


def reshard(unit: Unit, original: Any, fsdp_free: bool, *, pass_open: bool,
            freeing: bool) -> None:
    """FSDP1's ``FlatParamHandle.reshard`` (``original``) as the block runs it: not at
    all while nested passes run through the unit (``Unit.in_span``: its modules keep
    showing the unsharded parameters the next tile computes with, see
    ``_fsdp1_nested``), else freeing what ``should_free`` says."""
    if unit.in_span:
        return
    original(should_free(unit, fsdp_free, pass_open=pass_open, freeing=freeing))


def probe_reshard(unit: Unit) -> None:
    """What FSDP's post-backward hook would reshard after a probe pass's unit
    backward, without reducing."""
    handle = unit.handle
    if handle.needs_unshard():
        return
    handle._training_state = internals().HandleTrainingState.BACKWARD_POST
    internals().post_backward_reshard(unit.state, handle)


def pre_backward(unit: Unit) -> None:
    """FSDP1's per-unit pre-backward hook."""
    fsdp, state, handle = internals(), unit.state, unit.handle
    state.training_state = fsdp.TrainingState.FORWARD_BACKWARD
    handle._training_state = fsdp.HandleTrainingState.BACKWARD_PRE
    if handle._needs_pre_backward_unshard:
        if not handle._prefetched:
            fsdp.unshard(state, handle, state._unshard_stream, state._pre_unshard_stream)
        state._device_handle.current_stream().wait_stream(state._unshard_stream)
    handle._needs_pre_backward_unshard = False
    # FSDP's hook, which now returns early, would prefetch the unit next in
    # backward order here (a re-gathered unit after a kept one).
    fsdp.prefetch_handle(state, handle, fsdp.PrefetchMode.BACKWARD)
    handle.prepare_gradient_for_backward()
    handle._ran_pre_backward_hook = True


def _root_forward_running(model: Any) -> bool:
    """Whether the root's forward started and has not returned: Lightning's
    ``training_step`` (and its backward passes) runs inside it."""
    fsdp = internals()
    handle = model._handle
    return model.training_state == fsdp.TrainingState.FORWARD_BACKWARD and (
        handle is None or handle._training_state == fsdp.HandleTrainingState.FORWARD
    )


def _end_root_forward(model: Any) -> None:
    """What FSDP1's post-forward sets for the root (``_post_forward``,
    ``_register_pre_backward_hooks``), for a pass that starts inside the root's
    forward; its own post-forward, after the block, records the same again."""
    fsdp = internals()
    handle = model._handle
    model._exec_order_data.record_post_forward(handle)
    model._post_backward_callback_queued = False
    if handle is not None:
        # FSDP sets it when it hooks the root's outputs; there are none yet, and the
        # passes start from inside, where the block runs the root's pre-backward.
        # NO_SHARD gathers nothing (its unshard would re-point the views the graph saved).
        handle._needs_pre_backward_unshard = handle.uses_sharded_strategy
        handle._ran_pre_backward_hook = False
        handle._training_state = fsdp.HandleTrainingState.IDLE
    model.training_state = fsdp.TrainingState.IDLE


def open_inside_root_forward(model: Any, units: list[Unit], recorder: ForwardRecorder) -> None:
    """At install: whether the block opens inside the root's forward, noted on the
    recorder (with the root's ``AccumulateGrad`` node, taken now)."""
    if _root_forward_running(model):
        recorder.open_inside_root_forward(next((u for u in units if u.state is model), None))


def settle_root_forward(model: Any, recorder: ForwardRecorder) -> None:
    """At a pass start of a block opened inside the root's forward, once per forward
    since: what the root's post-forward would have set, and the units' records."""
    if recorder.inside_root_forward and recorder.forwards_unrecorded:
        if _root_forward_running(model):
            _end_root_forward(model)
        recorder.record_forward()


def rearm(model: Any, units: list[Unit], recorder: ForwardRecorder) -> None:
    """Undoes what FSDP's root final callback assumes about "the" backward."""
    for unit in units:
        flat_param = unit.flat_param
        if unit.acc_grads and not hasattr(flat_param, HOOK_STATE):
            # FSDP's final callback removed it; later passes must reduce too.
            node = unit.acc_grads[0]
            hook = node.register_hook(recorder.post_backward_fn(unit))
            setattr(flat_param, HOOK_STATE, (node, hook))
        if unit.regather:
            # The pre-backward unshard all-gathers only if the storage was
            # freed; it also shows the unsharded views that activation
            # checkpointing recomputes with.
            unit.handle._needs_pre_backward_unshard = True
            if unit.forward_tensors is not None:
                # use_orig_params=True re-points these views in the
                # pre-backward unshard; FSDP dropped them after backward.
                flat_param._tensors[:] = unit.forward_tensors
    # The forward order drives FSDP's backward prefetching.
    model._exec_order_data.handles_post_forward_order[:] = recorder.forward_order
    for unit in units:
        unit.handle._post_forward_index = unit.forward_index


def reshard_all(units: list[Unit]) -> None:
    """Frees every unit's unsharded flat parameter; communicates nothing."""
    fsdp = internals()
    for unit in units:
        handle = unit.handle
        handle._training_state = fsdp.HandleTrainingState.IDLE
        if handle.uses_sharded_strategy and not handle.needs_unshard():
            fsdp.reshard(unit.state, handle, True)


def reset_iteration(model: Any, states: list[Any], units: list[Unit]) -> None:
    """Leaves FSDP as its root final callback does after a backward."""
    fsdp = internals()
    for state in states:
        state.training_state = fsdp.TrainingState.IDLE
    model._post_backward_callback_queued = False
    model._exec_order_data.handles_post_forward_order.clear()
    for unit in units:
        handle, flat_param = unit.handle, unit.flat_param
        hook_state = getattr(flat_param, HOOK_STATE, None)
        if hook_state is not None:
            hook_state[-1].remove()
            delattr(flat_param, HOOK_STATE)
        handle._training_state = fsdp.HandleTrainingState.IDLE
        handle._needs_pre_backward_unshard = False
        handle._ran_pre_backward_hook = False
        handle._prefetched = False
        handle._post_forward_index = None
        if handle._use_orig_params and flat_param._tensors is not None:
            # The forward's views, as FSDP drops them after a unit's backward
            # (also for units an exception kept from running backward).
            flat_param._tensors[:] = [None] * len(flat_param._tensors)
