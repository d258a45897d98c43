"""The schema of a report: ``ReportRow`` (one backend and mode) and ``Report``.

The fields of ``ReportRow``, in order, are the keys of a row in ``report.json``;
a field marked ``_only(mode)`` is written in that mode's rows only. ``to_json``
and ``from_json`` convert to and from what ``report.json`` holds (and what
``run_report`` returns); ``from_json`` also reads reports written before
``expected_error`` and ``prefetched_all_gathers`` existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# The keys of ``ReportRow.breakdown``: bytes alive at the peak, by kind.
BREAKDOWN_KEYS = ("sharded_params", "unsharded_params", "grads", "activations", "other")


def _only(mode: str) -> Any:
    """A field (``None`` by default) that only ``mode``'s rows have."""
    return dataclasses.field(default=None, metadata={"only_mode": mode})


@dataclasses.dataclass(kw_only=True)
class ReportRow:
    """One backend and mode of a report run; peaks from the rank with the highest peak."""

    # What ran.
    mode: str
    label: str  # name[:sync_grads], e.g. keep:last
    backend: str
    sync_grads: str | None
    keep_unsharded: bool | int | None = None  # the library's option (None: no library)
    reshard_to: int | None = None  # the library's option (regather_node: --node-size)
    backwards: int | None = None  # passed to the library (None: no library)
    ok: bool
    error: str | None
    # Why ``error`` is the expected crash (None: the row failed, or ran).
    expected_error: str | None = None
    world_size: int
    simulated: bool
    fsdp_units: int | None = None
    # Memory of one step.
    peak_bytes: int | None = None
    peak_bytes_per_rank: list[int] | None = None
    memory_source: str | None = None
    tracker_peak_bytes: int | None = None
    breakdown: dict[str, int] | None = None  # BREAKDOWN_KEYS -> bytes
    breakdown_detail: dict[str, int] | None = None  # the tracker's own categories -> bytes
    breakdown_error: str | None = None
    # Medians of the timed steps, each step as long as its slowest rank.
    step_time_s: float | None = None
    timed_steps: int = 0
    forward2_time_s: float | None = None
    backward1_time_s: float | None = None
    # Collectives of one step.
    all_gathers_per_step: int | None = None
    reduce_scatters_per_step: int | None = None
    all_reduces_per_step: int | None = None
    all_gather_bytes_per_step: int | None = None
    reduce_scatter_bytes_per_step: int | None = None
    # All-gather bytes per rank by the ranks of the group that issued them ("64": bytes):
    # of the step, and of its passes after the first backward (``_hooks.LATER``).
    all_gather_bytes_by_group: dict[str, int] | None = None
    all_gather_bytes_between_passes: dict[str, int] | None = None
    # Of those between passes, on groups larger than --node-size (None: no --node-size).
    inter_node_all_gather_bytes_between_passes: int | None = None
    # [prefetched, could be] backward all-gathers (FSDP on real ranks).
    prefetched_all_gathers: list[int] | None = None
    # Against the two_forward row of the same backend (``add_comparisons``).
    time_ratio: float | None = None
    saved_time_s: float | None = None
    ideal_saving_s: float | None = None
    share_of_ideal_saving: float | None = None
    memory_overhead_bytes: int | None = None
    memory_bound_bytes: int | None = None
    memory_bound: str | None = None  # why the bound is what it is
    within_bound: bool | None = None
    # Backward 1 against keep's, and projected onto an H200 step (``add_probe_comparisons``).
    probe_backward_ratio: float | None = _only("probe")
    projected_h200_step_ratio: float | None = _only("probe")
    # Step time against keep's (``add_check_comparisons``).
    check_cost_ratio: float | None = _only("check")
    # Step time against one_backward's: the block's own cost for one pass
    # (``add_one_pass_comparisons``).
    one_pass_ratio: float | None = _only("one_pass")
    # Label -> step time of each library row of one forward with this row's sync_grads,
    # over this row's: the block's own cost over FSDP2 alone (``add_recipe_comparisons``).
    library_time_ratios: dict[str, float] | None = _only("fsdp2_recipe")

    @classmethod
    def json_keys(cls, mode: str) -> list[str]:
        """The keys of a ``mode`` row in ``report.json``, in order."""
        return [f.name for f in dataclasses.fields(cls)
                if f.metadata.get("only_mode", mode) == mode]

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.json_keys(self.mode)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReportRow:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"report row with unknown keys {sorted(unknown)}: written by "
                             "another version of fsdp_retain.report?")
        return cls(**data)


@dataclasses.dataclass
class Report:
    """A report run: its setup (``config``, as ``config_dict`` builds it) and its rows."""

    config: dict[str, Any]
    rows: list[ReportRow]

    def to_json(self) -> dict[str, Any]:
        """What ``report.json`` holds."""
        return {"config": self.config, "rows": [row.to_json() for row in self.rows]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Report:
        return cls(dict(data["config"]), [ReportRow.from_json(r) for r in data["rows"]])
