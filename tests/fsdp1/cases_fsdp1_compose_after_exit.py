"""FSDP1: a backward over the retained graph after the block exited (part of
``tests/fsdp1/cases_fsdp1_compose.py``).

A pass after the exit, after all known passes, over a forward-only block, from an
inner unit's output, or over an old graph inside a new block: a RuntimeError that
names the block and the fix, no FSDP1 state touched, FSDP1 usable afterwards.
"""

from __future__ import annotations

import pytest

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_snapshot
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_compose_utils import GRID, _check_usable, _tag, _warm_up, assert_same_state
from tests.support.harness import Registry
from tests.support.parity import LOSSES, batch, block_options, make_net, reference_copy

registry = Registry()


# --- Backward over the retained graph after the block exited ------------------


def _after_exit_message_ok(exc: BaseException) -> None:
    # The block's own error, not torch's setStorage / "not allocated" one.
    text = str(exc)
    assert text.startswith("no_reshard_between_backwards:"), text
    assert "Move this backward inside the block" in text, text


def _backward_after_exit_case(keep, sync, uop, variant):
    """A backward reaching a graph whose block has exited raises a RuntimeError that
    names the block and the fix, touches no FSDP state, and FSDP stays usable."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, use_orig_params=uop)
        _warm_up(model, ref)
        before = fsdp1_snapshot(model)
        inner = {}
        capture = model.blocks[1].register_forward_hook(
            lambda mod, args, out: inner.setdefault("out", out)
        )
        backwards = 2 if variant == "all_known_passes_done" else None
        with pytest.raises(RuntimeError) as caught:
            with no_reshard_between_backwards(model, **block_options(keep, sync, backwards)):
                out = model(batch(0))
                if variant != "forward_only_in_block":
                    LOSSES[0](out).backward(retain_graph=True)
                if variant == "all_known_passes_done":
                    LOSSES[1](out).backward(retain_graph=True)
            if variant == "inner_unit_output":
                # Not through the root's outputs: the unit's own outputs are guarded.
                inner["out"].sum().backward()
            elif variant == "old_graph_in_new_block":
                with no_reshard_between_backwards(model, **block_options(keep, sync)):
                    LOSSES[2](out).backward()
            else:
                LOSSES[2](out).backward()
        capture.remove()
        _after_exit_message_ok(caught.value)
        assert_same_state(model, before, variant)
        del out
        inner.clear()  # drops the graph the captured output holds
        _check_usable(model, ref, keep, sync)

    return run


for keep, sync, uop in GRID:
    registry.add(
        f"backward_after_exit_{_tag(keep, sync, uop)}",
        _backward_after_exit_case(keep, sync, uop, "pass_after_exit"),
    )
for keep, sync, uop, variant in (
    (True, "every", True, "all_known_passes_done"),
    (False, "last", False, "all_known_passes_done"),
    (True, "last", False, "forward_only_in_block"),
    (False, "every", True, "forward_only_in_block"),
    (True, "every", False, "inner_unit_output"),
    (False, "last", True, "inner_unit_output"),
    (True, "last", True, "old_graph_in_new_block"),
    (False, "every", False, "old_graph_in_new_block"),
):
    registry.add(
        f"backward_after_exit_{variant}_{_tag(keep, sync, uop)}",
        _backward_after_exit_case(keep, sync, uop, variant),
    )
