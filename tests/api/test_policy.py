"""The per-pass reading of the options (``Policy``), the pass count and the engine
entry wrapper, without ranks."""

import functools
import warnings

import pytest
import torch

from fsdp_retain import _pass_start
from fsdp_retain._lifecycle import BlockBase
from fsdp_retain._policy import PassTracker, Policy, RetainOptions


def _policy(**kwargs) -> Policy:
    return Policy(RetainOptions(**kwargs))


@pytest.mark.parametrize("backwards", [None, 1, 2, 3])
@pytest.mark.parametrize("sync_grads", ["every", "last"])
def test_reduces_and_is_last(sync_grads, backwards):
    policy = _policy(sync_grads=sync_grads, backwards=backwards)
    for index in range(1, 5):
        last = backwards is not None and index >= backwards
        assert policy.is_last(index) is last
        assert policy.reduces(index, probing=False) is (sync_grads == "every" or last)
        assert policy.reduces(index, probing=True) is False
    assert policy.holds_back is (sync_grads == "last")


@pytest.mark.parametrize(
    "keep, kept",
    [(True, {"root", "l2", "l1"}), (False, set()), (0, set()), (30, {"l2"}), (59, {"l2"}),
     (60, {"l2", "l1"}), (119, {"l2", "l1"}), (120, {"root", "l2", "l1"}),
     (10**9, {"root", "l2", "l1"})],
)
def test_kept_goes_by_all_gathers_saved_per_byte(keep, kept):
    # (unit, bytes, freed after forward) in backward order. A layer avoids 2 re-gathers
    # per step (pass 1 and pass 2), the root 1 (FSDP keeps it through pass 1): per byte
    # the layers go first, equal ones in backward order; the root is skipped, not the
    # end of the walk, when it does not fit.
    units = [("root", 60, False), ("l2", 30, True), ("l1", 30, True)]
    policy = _policy(keep_unsharded=keep)
    assert policy.kept(units) == kept
    assert policy.keeps_all is (keep is True)


@pytest.mark.parametrize("backwards, kept", [(None, {"root"}), (2, {"root"}), (4, {"root"})])
def test_kept_root_first_when_it_saves_more_per_byte(backwards, kept):
    # A root under half a layer's bytes avoids more all-gathers per byte than a layer.
    units = [("root", 10, False), ("l1", 30, True)]
    assert _policy(keep_unsharded=30, backwards=backwards).kept(units) == kept


@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize("freeing", [True, False])
def test_frees_after_pass(kept, freeing):
    assert Policy.frees_after_pass(kept, freeing=freeing) is (freeing or not kept)


def test_tracker_warns_once_for_extra_and_short():
    tracker = PassTracker(backwards=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tracker.begin() == 1
        tracker.end()
    assert not tracker.in_backward
    with pytest.warns(UserWarning, match="exited after 1 backward"):
        tracker.warn_if_short()
    tracker.begin()
    with pytest.warns(UserWarning, match="saw backward pass 3"):
        tracker.begin()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracker.begin()  # once only
    assert tracker.in_backward


def test_block_base_contract_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        BlockBase(torch.nn.Linear(1, 1), RetainOptions())  # type: ignore[abstract]


class _Watcher:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_backward(self) -> None:
        self.calls.append("before")

    def on_backward_start(self) -> None:
        self.calls.append("start")

    def map_inputs(self, inputs: tuple, accumulate: bool, roots: list,
                   nested: bool) -> tuple:
        self.calls.append(f"inputs {len(inputs)} {accumulate} {nested}")
        return inputs

    def after_backward(self) -> None:
        self.calls.append("after")

    def before_nested(self) -> None:
        self.calls.append("nested")

    def on_nested_start(self) -> None:
        self.calls.append("nested start")

    def after_nested(self) -> None:
        self.calls.append("nested done")


def _entry():
    return getattr(torch.autograd, _pass_start._ENTRY)


def _backward() -> None:
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()


def test_unwatch_restores_the_entry_it_replaced():
    original = _entry()
    watcher = _Watcher()
    _pass_start.watch(watcher)
    try:
        assert _entry() is not original
        _backward()
        assert watcher.calls == ["before", "start", "after"]
    finally:
        _pass_start.unwatch(watcher)
    assert _entry() is original


def test_unwatch_leaves_a_wrapper_installed_after_it():
    """Someone wraps the engine entry while a block watches: unwatch must not
    clobber that wrapper, and a later block must not run its watchers twice."""
    original = _entry()
    first = _Watcher()
    _pass_start.watch(first)
    ours = _entry()
    seen: list[int] = []

    @functools.wraps(ours)
    def theirs(*args, **kwargs):
        seen.append(1)
        return ours(*args, **kwargs)

    setattr(torch.autograd, _pass_start._ENTRY, theirs)
    try:
        _pass_start.unwatch(first)
        assert _entry() is theirs, "unwatch clobbered a wrapper installed after it"
        _backward()
        assert seen == [1] and first.calls == []
        second = _Watcher()
        _pass_start.watch(second)
        try:
            assert _entry() is theirs
            _backward()
            assert second.calls == ["before", "start", "after"], second.calls
            assert seen == [1, 1]
        finally:
            _pass_start.unwatch(second)
        assert _entry() is theirs
    finally:
        # The wrapper's owner puts back what it wrapped; ours then goes too.
        setattr(torch.autograd, _pass_start._ENTRY, ours)
        _pass_start.watch(first)
        _pass_start.unwatch(first)
    assert _entry() is original


def test_watchers_see_inputs_and_the_end_of_every_backward():
    """``map_inputs`` sees backward's and autograd.grad's inputs (accumulate or
    not); ``after_backward`` runs also when the engine raises."""
    watcher = _Watcher()
    _pass_start.watch(watcher)
    try:
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward(inputs=[x])
        torch.autograd.grad((x * 3).sum(), x)
        assert watcher.calls == [
            "inputs 1 True False", "before", "start", "after",
            "inputs 1 False False", "before", "start", "after",
        ], watcher.calls
        watcher.calls.clear()

        class Nested(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, g):
                with torch.enable_grad():
                    z = torch.ones(2, requires_grad=True)
                    torch.autograd.grad((z * 2).sum(), z)
                return g

        Nested.apply(x).sum().backward()
        assert watcher.calls == [
            "before", "start", "inputs 1 False True", "nested", "nested start", "nested done",
            "after",
        ], watcher.calls
        watcher.calls.clear()
        y = (x * 2).sum()
        y.backward()
        with pytest.raises(RuntimeError):
            y.backward()  # the graph was freed
        assert watcher.calls[-1] == "after", watcher.calls
    finally:
        _pass_start.unwatch(watcher)


def test_will_run_answers_true_for_the_root_of_a_single_root_backward():
    """The engine leaves the root of a single-root backward out of the nodes it
    will execute; ``will_run`` must not (a pass whose root is a unit's output)."""
    seen: list[bool] = []

    class Probe(_Watcher):
        def on_backward_start(self) -> None:
            seen.append(_pass_start.will_run(root))

    watcher = Probe()
    x = torch.ones(2, requires_grad=True)
    out = x * 2
    root = out.grad_fn
    _pass_start.watch(watcher)
    try:
        out.backward(torch.ones(2))
    finally:
        _pass_start.unwatch(watcher)
    assert seen == [True]


class _RecordingSpan:
    def __init__(self, log: list[str], index: int) -> None:
        self.log, self.index = log, index
        log.append(f"open {index}")

    def close(self) -> None:
        self.log.append(f"close {self.index}")

    def end_of_pass(self) -> None:
        self.log.append(f"end {self.index}")

    def abort(self) -> None:
        self.log.append(f"abort {self.index}")


def test_nested_passes_form_one_span_per_node():
    """The nested passes one node runs share a span (a nested pass inside them joins
    it, a close() from inside them does nothing); the node's end closes it; the pass
    end calls every span's end_of_pass; passes outside a block pass open none."""
    from fsdp_retain._nested import NestedPasses

    log: list[str] = []

    class Block:  # NestedPasses holds the block's method weakly
        def open_span(self) -> _RecordingSpan:
            return _RecordingSpan(log, sum(e.startswith("open") for e in log))

    block = Block()
    nested = NestedPasses(block.open_span)

    class Tiled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            for _ in range(3):  # three tiles, the second with a pass inside it
                nested.enter(True)
                try:
                    with torch.enable_grad():
                        z = torch.ones(2, requires_grad=True)
                        if len(log) == 1:
                            nested.enter(True)
                            nested.close()  # a unit's pre-backward inside: stays open
                            nested.leave()
                        (z * 2).sum().backward()
                finally:
                    nested.leave()
            return g

    x = torch.ones(2, requires_grad=True)
    (Tiled.apply(x) + Tiled.apply(x)).sum().backward()
    # Each node's span closes when the node is done (its post hook).
    assert log == ["open 0", "close 0", "open 1", "close 1"], log
    nested.end_pass()
    assert log[4:] == ["end 0", "end 1"], log
    nested.enter(False)  # inside a pass that is not the block's
    nested.leave()
    nested.end_pass()
    assert len(log) == 6, log
    del block  # gone: nested passes open no span
    nested.enter(True)
    nested.leave()
    nested.end_pass()
    assert len(log) == 6, log
