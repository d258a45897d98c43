"""``keep_unsharded`` as a byte budget (CPU, gloo, world size 2).

Run inside ranks by ``tests/options/test_budget.py``. The model is ``tests.support.parity.Net``
with each ``Block`` its own unit inside the root unit: 4 units, in backward order
the root, blocks[2], blocks[1], blocks[0]. Budgets of 0, one unit, two units and
all units (their unsharded bytes summed in that order) on FSDP1 FULL_SHARD (both
``use_orig_params``), SHARD_GRAD_OP and FSDP2; 2 and 3 passes, ``zero_grad()``
between passes, both ``sync_grads``, a probe pass first. Each case asserts:

- parity with the unsharded reference over 3 SGD-momentum steps;
- which units hold unsharded storage between passes: exactly the first ``k`` in
  backward order (a wrong choice of units fails here). This root (input and output
  layers, 288 parameters) is under half a block (661): it avoids fewer all-gathers
  (1 per step: FSDP keeps the root through pass 1) than a block (2) but more per
  byte, so the budget's order is the backward order;
- all-gathers per step from the formula below, reductions as without a budget.

All-gathers per step with ``k`` of ``n`` units kept and ``P`` passes: the forward
gathers every unit (``n``); pass 1 re-gathers the units freed after forward that
are not kept (the blocks not kept, for FULL_SHARD and FSDP2; none for
SHARD_GRAD_OP; never the root, which no backend frees after forward); every later
pass re-gathers every unit not kept (``n - k``).

The monotone cases give a root larger than the blocks (the report model's shape)
budgets from 0 to all bytes and count the all-gathers of one step: they never rise
(a budget keeps the blocks, 2 all-gathers saved each, before the root, 1).

The prefetch cases record, in each pass, the all-gathers issued against the
moment each unit's first module finishes its backward: a re-gathered unit's
all-gather must come while the unit before it computes (FSDP1 skipped that
after a kept unit, whose pre-backward the block runs at the pass start).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_handles
from fsdp_retain._fsdp2._inspect import fsdp2_param_groups
from fsdp_retain._measure import count_collectives
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.case_parts import covering
from tests.support.harness import Registry
from tests.support.parity import (
    DIM, LOSSES, Net, Scenario, batch, device, make_net, reference_copy, run_parity, world,
)

registry = Registry()
STRATEGIES = {
    "fsdp1_full_orig": (f1.FULL, True),
    "fsdp1_full_flat": (f1.FULL, False),
    "fsdp1_gradop_orig": (f1.GRAD_OP, True),
    "fsdp2": (None, None),
}


def _wrap(backend: str):
    model = make_net()
    ref = reference_copy(model)
    if backend == "fsdp2":
        return f2.wrap(model), ref, f2.ADAPTER
    strategy, uop = STRATEGIES[backend]
    return f1.wrap(model, strategy, use_orig_params=uop), ref, f1.ADAPTER


def units_in_backward_order(model: nn.Module, backend: str) -> list[tuple[str, int]]:
    """(unit name, unsharded bytes) for the root, blocks[2], blocks[1], blocks[0]."""
    if backend == "fsdp2":
        units = [("root", model)] + [(f"blocks.{i}", model.blocks[i]) for i in (2, 1, 0)]
        out = []
        for name, module in units:
            group = fsdp2_param_groups(module)[0]
            out.append((name, sum(p._orig_size.numel() * 4 for p in group.fsdp_params)))
        return out
    handles = fsdp1_handles(model)  # root first, then blocks in order
    names = ["root"] + [f"blocks.{i}" for i in range(len(handles) - 1)]
    # Before the first forward the flat parameter holds its padded shard.
    pairs = [(n, h.flat_param.numel() * world() * 4) for n, h in zip(names, handles)]
    return [pairs[0]] + pairs[1:][::-1]


def unsharded_units(model: nn.Module, backend: str) -> set[str]:
    """Units whose unsharded parameters own memory now."""
    if backend == "fsdp2":
        found = set()
        for name, module in [("root", model)] + [
            (f"blocks.{i}", b) for i, b in enumerate(model.blocks)
        ]:
            if not fsdp2_param_groups(module)[0].is_sharded:
                found.add(name)
        return found
    handles = fsdp1_handles(model)
    names = ["root"] + [f"blocks.{i}" for i in range(len(handles) - 1)]
    return {
        n for n, h in zip(names, handles) if h.flat_param._full_param_padded.untyped_storage().size()
    }


def expected_all_gathers(backend: str, n: int, k: int, passes: int) -> int:
    frees_after_forward = backend != "fsdp1_gradop_orig"
    blocks_not_kept = n - 1 - max(k - 1, 0)
    first = blocks_not_kept if frees_after_forward else 0
    return n + first + (passes - 1) * (n - k)


def budget_case(backend: str, k: int, passes: int, sync: str, zero: bool, probe: bool) -> None:
    model, ref, adapter = _wrap(backend)
    order = units_in_backward_order(model, backend)
    n = len(order)
    budget = sum(nbytes for _, nbytes in order[:k])
    kept = {name for name, _ in order[:k]}
    options = dict(keep_unsharded=budget, sync_grads=sync)
    if probe:
        # Pass 1 a probe pass, through the block's own call.
        _probe_then_parity(model, ref, adapter, backend, options, kept, passes)
        return

    def counts(c) -> None:
        assert c.all_gather == expected_all_gathers(backend, n, k, passes), (
            f"all-gathers {c.all_gather}, expected {expected_all_gathers(backend, n, k, passes)}"
            f" (n={n}, k={k}, passes={passes})"
        )
        reductions = n * (passes if sync == "every" else 1)
        assert c.reduce_scatter == reductions, (c.reduce_scatter, reductions)

    scenario = Scenario(
        passes=passes, zero_between=zero, steps=3, options=options,
        check_between=sync == "every",
    )
    run_parity(model, ref, scenario, adapter, expect_counts=counts)
    # Which units stayed unsharded between passes (one more step, observed).
    with no_reshard_between_backwards(model, **options):
        out = model(batch(9))
        LOSSES[0](out).backward(retain_graph=True)
        between = unsharded_units(model, backend)
        LOSSES[1](out).backward()
    model.zero_grad()
    assert between == kept, f"unsharded between passes {between}, kept {kept}"


def _probe_then_parity(model, ref, adapter, backend, options, kept, passes) -> None:
    from tests.support.parity import averaged_grads, assert_close_dicts, sgd

    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(3):
        x = batch(step)
        ref_out = ref(x)
        for i in range(1, passes):
            LOSSES[i % 3](ref_out).backward(retain_graph=i < passes - 1)
        ref_grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = ref_grads[name]
        ref_opt.step()
        ref_opt.zero_grad()
        with no_reshard_between_backwards(model, **options) as block:
            out = model(x)
            block.backward(LOSSES[0](out), param_grads=False, retain_graph=True)
            between = unsharded_units(model, backend)
            for i in range(1, passes):
                LOSSES[i % 3](out).backward(retain_graph=i < passes - 1)
        assert between == kept, f"unsharded after the probe pass {between}, kept {kept}"
        assert_close_dicts(adapter.full_grads(model), ref_grads, f"step {step}: grads")
        opt.step()
        opt.zero_grad()
        params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(adapter.full_params(model), params, f"step {step}: params")


# Every 3 of (backend, budget, passes, sync) meet in each combination of their values
# (32 of the 64).
for _backend, _k, (_passes, _zero), _sync in (tuple(_row.values()) for _row in covering(dict(
    backend=tuple(STRATEGIES), kept=(0, 1, 2, 4), run=((2, False), (3, True)),
    sync=("every", "last"),
), strength=3)):
    registry.add(
        f"budget_{_backend}_kept{_k}_p{_passes}{'_zero' if _zero else ''}_{_sync}",
        functools.partial(budget_case, _backend, _k, _passes, _sync, _zero, False),
    )
for _backend, _k in itertools.product(STRATEGIES, (1, 2)):
    registry.add(
        f"budget_{_backend}_kept{_k}_probe_first",
        functools.partial(budget_case, _backend, _k, 3, "every", False, True),
    )


class _WideRootNet(Net):
    """A root (input layer and a wide output head, 2604 parameters) of about four
    blocks (661 each), as the report model's embedding and output layer."""

    def __init__(self) -> None:
        super().__init__(DIM, depth=3)
        self.out = nn.Sequential(nn.Linear(DIM, 8 * DIM), nn.Tanh(), nn.Linear(8 * DIM, DIM))


def monotone_case(backend: str) -> None:
    """All-gathers per step (one forward, two backwards) never rise as the budget
    grows from 0 to every unit's bytes, by eighths, then ``True``."""
    torch.manual_seed(42)
    model = _WideRootNet().to(device())
    if backend == "fsdp2":
        model = f2.wrap(model)
    else:
        strategy, uop = STRATEGIES[backend]
        model = f1.wrap(model, strategy, use_orig_params=uop)
    total = sum(nbytes for _, nbytes in units_in_backward_order(model, backend))
    budgets: list[bool | int] = [total * i // 8 for i in range(9)] + [True]
    counts = []
    for step, budget in enumerate(budgets):
        with count_collectives() as c:
            with no_reshard_between_backwards(model, keep_unsharded=budget):
                out = model(batch(step))
                LOSSES[0](out).backward(retain_graph=True)
                LOSSES[1](out).backward()
        model.zero_grad()
        counts.append(c.all_gather)
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], (
        f"all-gathers per step for budgets {budgets}: {counts}")


for _backend in ("fsdp2", "fsdp1_full_orig", "fsdp1_gradop_orig"):
    registry.add(f"monotone_{_backend}", functools.partial(monotone_case, _backend))


class _AllGathers(TorchDispatchMode):
    """Appends ``"ag"`` to ``events`` for each all-gather op dispatched."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d.") and "allgather" in str(func).replace("_", ""):
            self.events.append("ag")
        return func(*args, **(kwargs or {}))


def _timeline(model: nn.Module, events: list[str]):
    """Records ``"ag"`` per all-gather issued and ``"<unit>"`` when the first module of
    a unit's backward is done (a full backward hook: after that unit's pre-backward
    hook, before the next unit's)."""
    import contextlib

    firsts = [("root", model.out)] + [(f"blocks.{i}", model.blocks[i].fc2) for i in (2, 1, 0)]
    handles = [
        module.register_full_backward_hook(lambda m, gi, go, name=name: events.append(name))
        for name, module in firsts
    ]
    stack = contextlib.ExitStack()
    stack.enter_context(_AllGathers(events))
    stack.callback(lambda: [h.remove() for h in handles])
    return stack


def prefetch_case(backend: str, k: int) -> None:
    """In every pass, each re-gathered unit's all-gather is issued while
    the unit before it in backward order computes (prefetched), not at its own
    pre-backward: when the first module of the ``j``-th unit's backward is done,
    the pass has issued at least the all-gathers of the re-gathered units among
    the first ``j + 2`` in backward order (without prefetch: among the first
    ``j + 1``), and at most one more (a kept unit prepared at the pass start
    prefetches from there; nothing is gathered further ahead). Pass 1
    re-gathers the units freed after forward that are not kept (no root; nothing
    under SHARD_GRAD_OP), later passes every unit not kept."""
    model, _, _ = _wrap(backend)
    order = units_in_backward_order(model, backend)
    budget = sum(nbytes for _, nbytes in order[:k])
    later = [name for name, _ in order[k:]]
    first = [] if backend == "fsdp1_gradop_orig" else [n for n in later if n != "root"]
    names = [name for name, _ in order]
    events: list[str] = []
    with _timeline(model, events):
        with no_reshard_between_backwards(model, keep_unsharded=budget):
            out = model(batch(0))
            for i in (0, 1, 2):
                events.append("pass")
                LOSSES[i](out).backward(retain_graph=i < 2)
    passes = "|".join(events).split("pass|")[1:]
    for p, text in enumerate(passes, start=1):
        regathered = first if p == 1 else later
        issued, at_mark = 0, {}
        for event in filter(None, text.split("|")):
            if event == "ag":
                issued += 1
            elif event not in at_mark:
                at_mark[event] = issued
        expected = {
            name: sum(n in regathered for n in names[: j + 2]) for j, name in enumerate(names)
        }
        assert all(expected[n] <= at_mark[n] <= expected[n] + 1 for n in names), (
            f"pass {p}, kept {k}: all-gathers issued when each unit's first module is done "
            f"{at_mark}, prefetched: {expected} or one more (timeline {text})"
        )


for _backend, _k in itertools.product(STRATEGIES, (0, 1, 2)):
    registry.add(f"prefetch_{_backend}_kept{_k}", functools.partial(prefetch_case, _backend, _k))
