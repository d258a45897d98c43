"""FSDP1's prefetch settings under the block (CPU, gloo), run inside ranks by
``tests/fsdp1/test_api_fsdp1_prefetch.py``.

The model is ``tests.support.parity.Net`` with 3 blocks: 4 units (the root and each
``Block``), so that a prefetch always has a next unit. Every row trains it for
``STEPS`` SGD-momentum steps beside an unsharded reference and checks:

- the losses, the gradients after every normal pass with ``sync_grads="every"``,
  the final gradients and the parameters after each step (names included: a unit
  left showing plain tensors instead of its parameters fails here);
- the collectives of each step by formula (``expected_counts``): a prefetch
  moves an all-gather earlier, it never adds one (where the last pass skips
  units, the all-gathers are bounded by that formula);
- FSDP1 as after a plain step once the block exited (``assert_restored``).

``GRID`` (world size 2, FULL_SHARD): ``backward_prefetch`` (None, BACKWARD_PRE,
BACKWARD_POST), ``sync_grads``, ``backwards`` (None, the number of passes),
``use_orig_params``, ``keep_unsharded`` (True, False, a budget keeping 2 of the 4
units), ``forward_prefetch``, ``limit_all_gathers`` and a probe pass first
(``block.backward(loss, param_grads=False, retain_graph=True)`` before the two
normal passes), so that every 3 of these factors meet in each combination of
their values (``covering``; ``pairwise_gaps`` checks every pair). ``EXTRA_ROWS``: SHARD_GRAD_OP and
NO_SHARD, ``backwards=N`` whose last pass reaches only ``blocks.0`` and the
root (the other units are reduced at the exit), ``backwards`` one more than the
passes run; ``HYBRID_ROWS`` on a (2, 2) mesh at world size 4.

With ``BackwardPrefetch.BACKWARD_POST`` and ``sync_grads="last"``, the reduction
the block runs at its exit (FSDP1's post-backward hook, outside any backward)
used to prefetch the unit before each one it reduced, as if a pass followed:
with ``use_orig_params=True`` that read views FSDP1 had dropped
(``AttributeError: 'NoneType' object has no attribute 'data'``) and the step's
gradients were lost; with NO_SHARD it left plain tensors in place of the
parameters; with flat parameters it all-gathered for nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_handles
from fsdp_retain._measure import count_collectives
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_checks import assert_restored
from tests.support.case_parts import covering
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    assert_close_dicts,
    averaged_grads,
    batch,
    make_net,
    reference_copy,
    sgd,
)

registry = Registry()

STEPS = 2
BACKWARD_PREFETCH = {
    "bpnone": None,
    "bppre": BackwardPrefetch.BACKWARD_PRE,
    "bppost": BackwardPrefetch.BACKWARD_POST,
}
KEEPS = ("keep", "regather", "half")  # True, False, a budget of 2 units of 4
KEPT_BY_BUDGET = 2


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration: FSDP1's settings, the block's options, the passes."""

    strategy: str = "full"  # one of the values of f1.STRATEGY_NAMES
    prefetch: str = "bppost"  # a key of BACKWARD_PREFETCH
    sync: str = "last"
    backwards: str = "none"  # "none", "exact" (the passes run), "short" (one more)
    orig: bool = True  # use_orig_params
    keep: str = "keep"  # one of KEEPS
    forward_prefetch: bool = False
    limit_all_gathers: bool = False
    probe: bool = False  # pass 1 a probe pass
    last_from_block0: bool = False  # the last pass starts at blocks.0's output

    @property
    def name(self) -> str:
        flags = [
            "fwdpf" if self.forward_prefetch else "",
            "limitag" if self.limit_all_gathers else "",
            "probe" if self.probe else "",
            "lastblock0" if self.last_from_block0 else "",
        ]
        return "_".join(
            [self.strategy, self.prefetch, self.sync, f"bw{self.backwards}",
             "orig" if self.orig else "flat", self.keep] + [f for f in flags if f]
        )

    @property
    def plan(self) -> str:
        """The passes of a step: ``p`` a probe pass, ``n`` a normal one."""
        return ("p" if self.probe else "") + "nn"

    def factors(self) -> dict[str, object]:
        return {
            "prefetch": self.prefetch, "sync": self.sync, "backwards": self.backwards,
            "orig": self.orig, "keep": self.keep, "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers, "probe": self.probe,
        }


def _grid() -> list[Row]:
    """Every 3 of the 8 factors (``DOMAINS``) meet in each combination of their values
    (``covering``), so ``pairwise_gaps`` finds nothing either."""
    return [Row(**row) for row in covering(DOMAINS, strength=3)]


# The values of each factor the grid must pair (see ``pairwise_gaps``).
DOMAINS: dict[str, tuple] = {
    "prefetch": tuple(BACKWARD_PREFETCH), "sync": ("every", "last"),
    "backwards": ("none", "exact"), "orig": (False, True), "keep": KEEPS,
    "forward_prefetch": (False, True), "limit_all_gathers": (False, True),
    "probe": (False, True),
}


def pairwise_gaps(rows: list[Row]) -> list[tuple]:
    """Pairs of factor values (``DOMAINS``) that no row has together (empty: pairwise)."""
    seen = {
        (a, row.factors()[a], b, row.factors()[b])
        for row in rows
        for a, b in itertools.combinations(DOMAINS, 2)
    }
    return [
        (a, va, b, vb)
        for a, b in itertools.combinations(DOMAINS, 2)
        for va in DOMAINS[a]
        for vb in DOMAINS[b]
        if (a, va, b, vb) not in seen
    ]


GRID = _grid()
EXTRA_ROWS = (
    # Other strategies through the same exit reduction.
    [
        Row(strategy=s, sync=sync, orig=orig, keep=KEEPS[i % 3], probe=i % 2 == 1,
            forward_prefetch=i == 1, limit_all_gathers=i == 2)
        for s in ("gradop", "noshard")
        for i, (sync, orig) in enumerate(itertools.product(("every", "last"), (False, True)))
    ]
    # backwards=N: the last pass leaves blocks.1 and blocks.2 to the exit.
    + [
        Row(prefetch=bp, backwards="exact", orig=orig, keep=keep, last_from_block0=True)
        for bp, orig, keep in [
            ("bppost", True, "keep"), ("bppost", True, "regather"), ("bppost", True, "half"),
            ("bppost", False, "regather"), ("bppre", True, "half"), ("bpnone", True, "regather"),
        ]
    ]
    # backwards one more than the passes run: every unit reduced at the exit.
    + [Row(backwards="short", keep=keep, probe=keep == "half") for keep in KEEPS]
)
HYBRID_ROWS = [
    Row(strategy="hybrid", orig=orig, keep=keep, probe=orig and keep == "keep")
    for orig, keep in itertools.product((False, True), ("keep", "half"))
]


# One step #
def _wrap(row: Row):
    model = make_net(depth=3)
    ref = reference_copy(model)
    strategy = {v: k for k, v in f1.STRATEGY_NAMES.items()}[row.strategy]
    model = f1.wrap(
        model, strategy, use_orig_params=row.orig,
        backward_prefetch=BACKWARD_PREFETCH[row.prefetch],
        forward_prefetch=row.forward_prefetch,
        limit_all_gathers=row.limit_all_gathers,
    )
    return model, ref


def _unit_bytes_in_backward_order(model) -> list[int]:
    """Unsharded bytes of the root, blocks.2, blocks.1, blocks.0 (0 for NO_SHARD).

    Before the first forward each flat parameter holds its padded shard.
    """
    sizes = [
        h.flat_param.numel() * dist.get_world_size(h.process_group) * h.flat_param.element_size()
        if h.uses_sharded_strategy else 0
        for h in fsdp1_handles(model)  # the root first, then the blocks in order
    ]
    return [sizes[0]] + sizes[1:][::-1]


def keep_option(row: Row, model) -> bool | int:
    if row.keep == "half":
        return sum(_unit_bytes_in_backward_order(model)[:KEPT_BY_BUDGET])
    return row.keep == "keep"


def expected_counts(row: Row, units: int) -> dict[str, int]:
    """Collectives per step with ``k`` of ``n`` units kept and ``P`` passes.

    All-gathers (none for NO_SHARD): the forward gathers every unit (``n``);
    pass 1 re-gathers the units freed after forward that are not kept (every
    block not kept for FULL_SHARD and HYBRID_SHARD; none for SHARD_GRAD_OP;
    never the root, which comes first in the budget's order); every later pass,
    probe passes included, re-gathers each unit not kept (``n - k``).
    Reductions: one per unit per normal pass ("every"), else one per unit;
    reduce-scatters for the sharded strategies, all-reduces for NO_SHARD and
    (across replicas) HYBRID_SHARD.
    """
    n, passes = units, len(row.plan)
    k = {"keep": n, "regather": 0, "half": KEPT_BY_BUDGET}[row.keep]
    if row.strategy == "noshard":
        all_gather = 0
    else:
        first = n - 1 - max(k - 1, 0) if row.strategy in ("full", "hybrid") else 0
        all_gather = n + first + (passes - 1) * (n - k)
    normal = row.plan.count("n")
    reductions = n * (normal if row.sync == "every" else 1)
    return dict(
        all_gather=all_gather,
        reduce_scatter=0 if row.strategy == "noshard" else reductions,
        all_reduce=reductions if row.strategy in ("noshard", "hybrid") else 0,
    )


class _Block0Output:
    """Keeps the output of ``model.blocks[0]`` from the last forward."""

    def __init__(self, model) -> None:
        self.out: torch.Tensor | None = None
        model.blocks[0].register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.out = output


def _losses(row: Row, out: torch.Tensor, block0: _Block0Output) -> list[torch.Tensor]:
    losses = [LOSSES[i % len(LOSSES)](out) for i in range(len(row.plan))]
    if row.last_from_block0:
        losses[-1] = block0.out.pow(2).mean()
    return losses


def _reference_step(row: Row, ref, block0, x) -> tuple[list, list]:
    """Normal passes only (a probe pass adds nothing); grads after each, averaged."""
    losses = _losses(row, ref(x), block0)
    normal = [loss for kind, loss in zip(row.plan, losses) if kind == "n"]
    after = []
    for i, loss in enumerate(normal):
        loss.backward(retain_graph=i < len(normal) - 1)
        after.append(averaged_grads(ref))
    return [loss.detach() for loss in losses], after


def _block_step(row: Row, model, block0, x, keep):
    passes = len(row.plan)
    backwards = {"none": None, "exact": passes, "short": passes + 1}[row.backwards]
    losses, between = [], []
    with count_collectives() as counts, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with no_reshard_between_backwards(
            model, keep_unsharded=keep, sync_grads=row.sync, backwards=backwards
        ) as block:
            for i, (kind, loss) in enumerate(zip(row.plan, _losses(row, model(x), block0))):
                block.backward(loss, param_grads=kind == "n", retain_graph=i < passes - 1)
                losses.append(loss.detach())
                if kind == "n" and row.sync == "every" and i < passes - 1:
                    with counts.excluded():
                        between.append(f1.full_grads(model))
            assert block.backward_passes == passes, block.backward_passes
    short = [w for w in seen if "exited after" in str(w.message)]
    assert bool(short) == (row.backwards == "short"), [str(w.message) for w in seen]
    return losses, between, counts


def run_row(row: Row) -> None:
    model, ref = _wrap(row)
    keep = keep_option(row, model)
    block0, ref_block0 = _Block0Output(model), _Block0Output(ref)
    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(STEPS):
        expected = expected_counts(row, len(fsdp1_handles(model)))
        where = f"{row.name}, step {step}"
        x = batch(step)
        ref_losses, ref_grads = _reference_step(row, ref, ref_block0, x)
        losses, between, counts = _block_step(row, model, block0, x, keep)
        assert_restored(model)
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            torch.testing.assert_close(a, b, msg=f"{where}: loss {i + 1}")
        for i, grads in enumerate(between):
            assert_close_dicts(grads, ref_grads[i], f"{where}: grads after normal pass {i + 1}")
        assert_close_dicts(f1.full_grads(model), ref_grads[-1], f"{where}: final grads")
        got = counts.as_dict()
        if row.last_from_block0:
            # The last pass gathers fewer units (FSDP1's prefetch may add one it
            # does not use): at most what a last pass over every unit gathers.
            most = expected.pop("all_gather")
            assert got.pop("all_gather") <= most, f"{where}: {counts.by_op}, at most {most}"
        assert got == expected, f"{where}: collectives {counts.by_op}, expected {expected}"
        for name, param in ref.named_parameters():
            param.grad = ref_grads[-1][name].clone()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(f1.full_params(model), params, f"{where}: params")


for _row in GRID + EXTRA_ROWS:
    registry.add(_row.name, functools.partial(run_row, _row))
for _row in HYBRID_ROWS:
    registry.add(_row.name, functools.partial(run_row, _row), world_sizes=(4,))
