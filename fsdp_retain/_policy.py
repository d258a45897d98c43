"""The block's options, validated, and what they mean for each pass: the one place
that reads them.

``Policy`` answers the questions every backend asks (does this pass reduce?
is it the last known one? which units stay unsharded? may a unit be freed
now?); ``PassTracker`` counts the passes. Neither touches torch internals, so
both are unit-tested without ranks (``tests/api/test_policy.py``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Hashable, Iterable
from typing import TypeVar

Unit = TypeVar("Unit", bound=Hashable)

_SYNC_GRADS = ("every", "last")


@dataclasses.dataclass(frozen=True)
class RetainOptions:
    """The keyword options of ``no_reshard_between_backwards``, validated."""

    keep_unsharded: bool | int = True
    sync_grads: str = "every"
    backwards: int | None = None
    check_saved_tensors: bool = False
    reshard_to: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keep_unsharded, int):  # bool is an int
            raise TypeError(
                f"keep_unsharded must be a bool or an int, got {self.keep_unsharded!r}: "
                "pass True to keep parameters unsharded between backward passes, "
                "False to re-gather them per layer, or a per-rank byte budget such as "
                "8 * 2**30 to keep the units that fit"
            )
        if not isinstance(self.keep_unsharded, bool) and self.keep_unsharded < 0:
            raise ValueError(
                f"keep_unsharded as a byte budget must be >= 0, got {self.keep_unsharded}: "
                "pass the bytes of unsharded parameters each rank may hold between "
                "passes (0 keeps nothing, like False)"
            )
        if self.sync_grads not in _SYNC_GRADS:
            raise ValueError(
                f"sync_grads must be one of {_SYNC_GRADS}, got {self.sync_grads!r}: "
                "'every' reduces gradients after each backward (readable .grad "
                "between passes), 'last' reduces them once after the last backward"
            )
        if self.backwards is not None and (
            isinstance(self.backwards, bool)
            or not isinstance(self.backwards, int)
            or self.backwards < 1
        ):
            raise ValueError(
                f"backwards must be a positive int or None, got {self.backwards!r}: "
                "pass the number of backward passes you will run inside the block, "
                "or None if it is not known in advance"
            )
        if not isinstance(self.check_saved_tensors, bool):
            raise TypeError(
                f"check_saved_tensors must be a bool, got {self.check_saved_tensors!r}: "
                "pass True to check that tensors saved for backward are unchanged when "
                "a later pass reads them, or False (the default) to skip the check"
            )
        self._check_reshard_to()

    def _check_reshard_to(self) -> None:
        value = self.reshard_to
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(
                f"reshard_to must be an int >= 2 or None, got {value!r}: pass the number "
                "of ranks each unit not kept unsharded is resharded to between backward "
                "passes (e.g. the GPUs of one node, 8), so that later passes all-gather "
                "inside those groups only; None reshards to every rank of the unit's mesh"
            )
        if self.keep_unsharded is True:
            warnings.warn(
                f"no_reshard_between_backwards(reshard_to={value}) has no effect with "
                "keep_unsharded=True: every unit stays unsharded between passes. Pass "
                "keep_unsharded=False or a byte budget to reshard the others to groups "
                f"of {value} ranks.",
                stacklevel=4,
            )


    def check_reshard_to(self, backend: str, shard_groups: Iterable[ShardGroup] = ()) -> None:
        """Raises unless ``backend`` can keep the re-gathers between passes inside
        groups of ``reshard_to`` ranks (FSDP2 always can and does not ask): FSDP1 where
        every unit (``shard_groups``) is ``HYBRID_SHARD`` (or ``_HYBRID_SHARD_ZERO2``)
        with a shard group of that many ranks, which is where it re-gathers anyway;
        DeepSpeed ZeRO-3 never."""
        if self.reshard_to is None:
            return
        groups = list(shard_groups) if backend == "FSDP1" else [None]
        for group in groups:
            if group is None or group.strategy not in HYBRID or group.ranks != self.reshard_to:
                raise reshard_to_refusal(self.reshard_to, backend, group)


HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """How FSDP1 shards one unit: its name, its ``ShardingStrategy`` name and the ranks
    that shard it (``HYBRID_SHARD``: its shard group, one node)."""

    unit: str
    strategy: str
    ranks: int


def reshard_to_refusal(
    reshard_to: int, backend: str, group: ShardGroup | None = None
) -> ValueError:
    """``reshard_to`` on a backend without groups of that many ranks to re-gather in:
    DeepSpeed ZeRO-3, or FSDP1 where ``group`` is not ``HYBRID_SHARD`` over
    ``reshard_to`` ranks."""
    fsdp2 = (
        f"wrap the model with fully_shard(...) to keep the re-gathers between passes "
        f"inside groups of {reshard_to} ranks"
    )
    if backend == "DeepSpeed ZeRO-3":
        return ValueError(
            f"no_reshard_between_backwards(reshard_to={reshard_to}) needs FSDP2 "
            "(fully_shard), got a DeepSpeed ZeRO-3 model. On ZeRO-3 the re-gathers "
            "between passes stay inside groups of N ranks with ZeRO++'s hierarchical "
            f"partitioning: set \"zero_hpz_partition_size\": {reshard_to} in the DeepSpeed "
            f"config's zero_optimization and drop reshard_to, or {fsdp2}."
        )
    if backend == "DDP":
        return ValueError(
            f"no_reshard_between_backwards(reshard_to={reshard_to}) has nothing to reshard "
            "on DistributedDataParallel: every rank holds every parameter, so no pass "
            "re-gathers. Drop reshard_to (keep_unsharded has no effect on DDP either)."
        )
    where = "" if group is None else (
        f" whose unit {group.unit!r} uses {group.strategy} over {group.ranks} rank(s)"
    )
    if group is not None and group.strategy in HYBRID:
        fix = (
            f"FSDP1 re-gathers a {group.strategy} unit inside its shard group, here of "
            f"{group.ranks} ranks: pass reshard_to={group.ranks} (or drop it), build the "
            f"device_mesh with a shard dimension of {reshard_to} ranks"
        )
    else:
        fix = (
            "FSDP1 reshards a unit only to its whole sharding group: wrap it with "
            "sharding_strategy=ShardingStrategy.HYBRID_SHARD and a device_mesh whose shard "
            f"dimension has {reshard_to} ranks (re-gathers between passes then stay "
            "inside it), drop reshard_to"
        )
    return ValueError(
        f"no_reshard_between_backwards(reshard_to={reshard_to}) needs FSDP2 "
        f"(fully_shard) or FSDP1 HYBRID_SHARD over shard groups of {reshard_to} ranks, "
        f"got a FSDP1 model{where}. {fix}, or {fsdp2}."
    )


def regathers_saved(frees_after_forward: bool, passes: int) -> int:
    """All-gathers per step that keeping a unit unsharded avoids, with ``passes``
    backward passes: one in each pass after the first, and one in pass 1 when FSDP
    frees the unit after forward (every unit but the root, under FSDP's defaults)."""
    return passes - 1 + frees_after_forward


def kept_units(
    units: Iterable[tuple[Unit, int, bool]],
    keep_unsharded: bool | int,
    passes: int | None = None,
) -> set[Unit]:
    """The units whose unsharded parameters a block keeps between passes.

    ``units`` are ``(unit, unsharded parameter bytes per rank, FSDP frees it after
    forward)`` in backward order, the unit whose backward runs first first.
    ``True`` keeps every unit, ``False`` none. A byte budget keeps the units
    that avoid the most all-gathers per byte first (``regathers_saved`` over
    the unit's bytes, with ``passes`` backward passes, at least 2), each one
    whose bytes still fit in what is left; a unit too large for the rest is
    skipped, not the end of the walk. Ties go in backward order, the unit whose
    re-gather no prefetch can hide (the first) first. So a layer, re-gathered
    in both passes, goes before a root (embedding and output layer, kept
    through pass 1 by FSDP itself) of more than half its bytes.

    All-gathers per step never rise as the budget grows: where a larger budget
    first keeps a unit that a smaller one skipped, the smaller one had less than
    the unit's bytes left, and what it kept in them avoids no more all-gathers
    per byte than that unit (``tests/options/test_budget.py`` checks it). Units that
    free nothing (0 bytes, e.g. ``NO_SHARD``) are always kept.
    """
    if isinstance(keep_unsharded, bool):
        return {unit for unit, _, _ in units} if keep_unsharded else set()
    kept, left = set(), keep_unsharded
    for unit, nbytes, _ in keep_order(units, passes):
        if nbytes <= left:
            kept.add(unit)
            left -= nbytes
    return kept


def keep_order(
    units: Iterable[tuple[Unit, int, bool]], passes: int | None = None,
) -> list[tuple[Unit, int, bool]]:
    """``units`` (as ``kept_units`` takes them) in the order a byte budget keeps them:
    the most all-gathers saved per byte first, ties in backward order. A budget of
    the bytes of the first ``j`` keeps exactly those ``j``."""
    passes = max(passes or 2, 2)

    def order(item: tuple[int, tuple[Unit, int, bool]]) -> tuple[float, int]:
        index, (_, nbytes, frees) = item
        saved = regathers_saved(frees, passes)
        return (-saved / nbytes if nbytes else -math.inf), index

    return [unit for _, unit in sorted(enumerate(units), key=order)]


@dataclasses.dataclass(frozen=True)
class Policy:
    """The options of one block, read per pass."""

    options: RetainOptions

    @property
    def holds_back(self) -> bool:
        """``sync_grads="last"``: passes before the last keep gradients unreduced."""
        return self.options.sync_grads == "last"

    @property
    def keeps_all(self) -> bool:
        """``keep_unsharded=True`` (not a budget): every unit stays unsharded."""
        return self.options.keep_unsharded is True

    def is_last(self, index: int) -> bool:
        """Whether pass ``index`` (1-based) is the last one the user announced."""
        return self.options.backwards is not None and index >= self.options.backwards

    def reduces(self, index: int, *, probing: bool) -> bool:
        """Whether pass ``index`` reduces the gradients it accumulates."""
        return not probing and (not self.holds_back or self.is_last(index))

    def kept(self, units: Iterable[tuple[Unit, int, bool]]) -> set[Unit]:
        """The units kept unsharded between passes: see ``kept_units``."""
        return kept_units(units, self.options.keep_unsharded, self.options.backwards)

    def between_passes_ranks(self, built_with: int | None) -> int | None:
        """How many ranks a unit not kept unsharded is resharded to between passes:
        ``reshard_to``, else the group size FSDP2 reshards it to after forward
        (``built_with``: ``reshard_after_forward=<int>``), else ``None``, every rank
        of its mesh."""
        return self.options.reshard_to or built_with

    @staticmethod
    def regroups(*, freeing: bool) -> bool:
        """Whether a backward reshards a unit the budget does not keep to its group of
        ranks (``between_passes_ranks``) rather than to every rank: not in the last
        announced pass nor at the block exit (``freeing``), which leave every unit as
        FSDP leaves it after a plain backward."""
        return not freeing

    @staticmethod
    def frees_after_pass(kept: bool, *, freeing: bool) -> bool:
        """Whether a unit's backward frees its unsharded parameters.

        ``freeing``: the last announced pass runs, or the block exits. A unit
        the budget does not keep is freed after every pass, even where FSDP
        itself would keep it (``keep_unsharded=False`` promises no memory
        between passes).
        """
        return freeing or not kept


class PassTracker:
    """Counts backward passes inside one block and checks them against ``backwards``."""

    def __init__(self, backwards: int | None) -> None:
        self.backwards = backwards
        self.started = 0
        self.finished = 0
        # A pass computed parameter gradients, or apply_grads added some: what the
        # optimizer steps on changed (see [Note: who steps and who scales on DeepSpeed]).
        self.wrote = False
        self._warned_extra = False

    def begin(self, writes: bool = True) -> int:
        """Registers the start of a backward pass (``writes``: one that computes
        parameter gradients, not a probe or ``block.grads`` pass); returns its 1-based
        index."""
        self.started += 1
        self.wrote = self.wrote or writes
        if (
            self.backwards is not None
            and self.started > self.backwards
            and not self._warned_extra
        ):
            self._warned_extra = True
            warnings.warn(
                f"no_reshard_between_backwards(backwards={self.backwards}) saw backward "
                f"pass {self.started}: parameters were already resharded after pass "
                f"{self.backwards}, so this pass gathers them again (gradients stay "
                "correct, memory and communication do not). Pass the real number of "
                "passes, or backwards=None.",
                stacklevel=2,
            )
        return self.started

    def end(self) -> None:
        self.finished += 1

    @property
    def in_backward(self) -> bool:
        return self.started > self.finished

    def warn_if_short(self) -> None:
        if self.backwards is not None and 0 < self.started < self.backwards:
            warnings.warn(
                f"no_reshard_between_backwards(backwards={self.backwards}) exited after "
                f"{self.started} backward pass(es); parameters were kept until the end "
                "of the block. Pass the real number of passes, or backwards=None.",
                stacklevel=3,
            )
