"""What a ZeRO-3 block does for nested backward passes: see [Note: nested backward
passes] in ``_nested.py`` (stages 0-2 use ``GradStashSpan`` there: [Note: nested passes
on replicated gradients]).

Part of the DeepSpeed backend with ``_block.py`` (private DeepSpeed access).

[Note: ZeRO-3 reductions in a span]
ZeRO-3 reduces from each parameter's ``AccumulateGrad`` hook: it moves ``.grad``
into the reduce bucket (``reduce_ready_partitions_and_remove_grads``), and the
bucket is reduce-scattered at the end of the pass (or when full). A tile's pass
runs that hook once per tile for the same parameter: the bucket then holds the
parameter twice, and ZeRO-3 fails on ``len(set(p.ds_id ...)) == len(params_in_bucket)``
(an ``AssertionError``, plain ZeRO-3 as well), or, with a full bucket in between,
copies a later tile over the partition of an earlier one. ``sync_grads="last"``
holds every hook (``_coalesce_grad_reduction``), so it is right, except in a
probe pass: the tiles' passes write ``.grad``, which a later pass then reduces.

So while a span is open the optimizer's ``reduce_ready_partitions_and_remove_grads``
only records the parameter: the tiles accumulate into ``.grad``. At the close each
recorded parameter goes through the real one once (which holds it back for
``"last"``), and the end of the outer pass reduce-scatters the bucket as usual: one
reduce-scatter per pass, whatever the number of tiles. The hooks' bookkeeping of
the pass (``_backward_hook_state``: hooks fired, the post-backward callback) is put
back at the close, so the nested passes neither run the engine's epilogue at their
own end nor change when the outer pass runs it. With ``keep_unsharded=False`` the
coordinator's release is held too, so a parameter is gathered once per span, not
once per tile and direction, and released (locally) at the close.
"""

from __future__ import annotations

from typing import Any

from .._nested import Span, put_grads, take_grads

_MISSING = object()
_REDUCE = "reduce_ready_partitions_and_remove_grads"
_HOOK_STATE = (
    "remaining_grad_acc_hooks",
    "backward_active_depth",
    "backward_seen_this_step",
    "epilogue_ran_this_backward",
    "hooks_fired_this_backward",
    "max_expected_hooks_seen",
    "post_backward_callback_queued",
    "post_backward_callback_graph_task_id",
)


class DeepSpeedSpan(Span):
    """The nested passes of one node: see [Note: ZeRO-3 reductions in a span]."""

    def __init__(self, optimizer: Any, params: list[Any], probing: bool,
                 coordinator: Any, release_name: str | None) -> None:
        self._opt = optimizer
        self._touched: dict[int, Any] = {}
        self._restored = False
        state = optimizer._backward_hook_state
        self._hook_state = {name: getattr(state, name) for name in _HOOK_STATE}
        state.post_backward_callback_queued = True  # no epilogue at a tile's end
        optimizer.__dict__[_REDUCE] = self._record
        # keep_unsharded=False: keep what the tiles gather until the close.
        self._coordinator, self._release_name = coordinator, release_name
        self._held: dict[int, Any] = {}
        self._release: Any = None
        self._own_release = _MISSING  # what the coordinator's __dict__ held
        if release_name is not None:
            self._release = getattr(coordinator, release_name)
            self._own_release = coordinator.__dict__.get(release_name, _MISSING)
            coordinator.__dict__[release_name] = self._hold
        # A probe pass writes no parameter gradient: set aside what the parameters hold.
        self._stash = take_grads(params) if probing else None

    def _record(self, param: Any) -> None:
        self._touched[id(param)] = param

    def _hold(self, param: Any, free_data: bool = True) -> None:
        self._held[id(param)] = param

    def close(self) -> None:
        self._restore()
        touched = list(self._touched.values())
        self._touched.clear()
        if self._stash is not None:
            put_grads(touched, self._stash)
        else:
            queued = _queued(self._opt)
            for param in touched:
                # A parameter the outer pass queued already: the tiles added to its
                # .grad, a view of the bucket.
                if param.grad is not None and id(param) not in queued:
                    self._opt.reduce_ready_partitions_and_remove_grads(param)
            if touched:
                self._opt.queue_post_backward_callback()  # loss.backward(): the epilogue
        self._release_held()

    def abort(self) -> None:
        self._restore()
        if self._stash is not None:
            put_grads(list(self._touched.values()), self._stash)
        self._touched.clear()
        self._release_held()

    def _restore(self) -> None:
        """The optimizer's reduce and hook state, the coordinator's release (once)."""
        if self._restored:
            return
        self._restored = True
        self._opt.__dict__.pop(_REDUCE, None)
        state = self._opt._backward_hook_state
        for name, value in self._hook_state.items():
            setattr(state, name, value)
        if self._release is not None:
            self._coordinator.__dict__.pop(self._release_name, None)
            if self._own_release is not _MISSING:
                self._coordinator.__dict__[self._release_name] = self._own_release

    def _release_held(self) -> None:
        held = list(self._held.values())
        self._held.clear()
        if self._release is not None:
            for param in held:
                self._release(param)  # only if gathered and no module still uses it


def _queued(optimizer: Any) -> set[int]:
    return {id(p) for bucket in optimizer.ipg_buckets.values() for p in bucket.params}
