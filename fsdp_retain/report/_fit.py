"""``--gpu-memory``: the largest ``keep_unsharded`` budget that fits, per backend.

From the measured (or simulated) peaks of the modes a run has: ``regather``
(budget 0), the ``keep<pct>`` budget modes and ``keep`` (every unit), the
largest whose peak per rank is within the GPU memory, with its all-gathers per
step from the units it keeps. Units and the kept set follow the library's own
policy (``kept_units``) over the model's units in backward order: the root
(kept through pass 1 by FSDP itself), then the decoder layers last to first
(freed after forward).
"""

from __future__ import annotations

import re
from typing import Any

from .._policy import kept_units
from ._modes import BACKWARDS, MODES

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"141 GiB"``, ``"80e9"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"--gpu-memory {text!r}: use a size such as 80GiB, 141GiB or 80e9")
    return int(float(match.group(1)) * unit)


def human_bytes(nbytes: int) -> str:
    """``"79.33 GiB"``, or MiB under a GiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def unit_bytes(model, layers) -> list[int]:
    """Unsharded parameter bytes per unit in backward order: the root, then the layers
    last to first (one unit each, as the report shards them)."""
    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    per_layer = [nbytes(layer) for layer in layers]
    return [nbytes(model) - sum(per_layer)] + per_layer[::-1]


def _fraction(label: str) -> float | None:
    name = label.partition(":")[0]
    if name == "regather":
        return 0.0
    if name == "keep":
        return 1.0
    spec = MODES.get(name)
    return spec.budget if spec is not None and spec.budget is not None else None


def kept_count(units: list[int], budget: int) -> int:
    """How many units the library keeps with ``budget`` (``units`` as ``unit_bytes``)."""
    return len(kept_units_of(units, budget))


def kept_units_of(units: list[int], budget: int) -> set[int]:
    """The units (indices into ``units``, as ``unit_bytes`` gives them) kept with ``budget``."""
    return kept_units([(i, n, i > 0) for i, n in enumerate(units)], budget, BACKWARDS)


def all_gathers(units: list[int], budget: int, frees_after_forward: bool) -> int:
    """All-gathers per step with ``BACKWARDS`` passes: the forward gathers every unit;
    pass 1 the layers freed after forward and not kept; later passes every unit not kept."""
    kept = kept_units_of(units, budget)
    n, k = len(units), len(kept)
    layers_not_kept = sum(1 for i in range(1, n) if i not in kept)
    return n + (layers_not_kept if frees_after_forward else 0) + (BACKWARDS - 1) * (n - k)


def gathers_by_node(units: list[int], budget: int, grouped: bool,
                    hybrid: bool = False) -> tuple[int, int, int]:
    """``(intra-node, inter-node all-gathers per step, inter-node all-gather bytes between
    passes)`` with ``budget``, ``grouped``: ``reshard_to=<node size>``. The forward and pass 1
    gather from every rank (inter-node, as ``all_gathers``); the later passes re-gather the
    units not kept, inside the node where they were resharded to it. Bytes: each all-gather's
    output (the unit's unsharded bytes), as the report's rows count them. ``hybrid``: FSDP1
    ``HYBRID_SHARD`` over one node, where every all-gather stays inside it."""
    kept = kept_units_of(units, budget)
    total = all_gathers(units, budget, frees_after_forward=True)
    if hybrid:
        return total, 0, 0
    later = (BACKWARDS - 1) * (len(units) - len(kept))
    later_bytes = (BACKWARDS - 1) * sum(n for i, n in enumerate(units) if i not in kept)
    if grouped:
        return later, total - later, 0
    return 0, total, later_bytes


def render_budget_fit(report: dict[str, Any], gpu_memory: int) -> str:
    cfg, rows = report["config"], report["rows"]
    units = cfg.get("unit_bytes") or []
    unsharded = sum(units)
    gib = 2**30
    lines = [
        f"Largest keep_unsharded budget that fits in {gpu_memory / gib:.0f} GiB per rank "
        f"({cfg['model']}, {cfg['dtype']}, batch {cfg['batch_per_rank']} x {cfg['seq_len']}, "
        f"world size {cfg['world_size']}{' (simulated)' if cfg['simulated'] else ''}; "
        "among the modes run: regather = 0, keep<pct> = pct% of the unsharded parameters, "
        "keep = all):",
        "",
        "| backend | sync_grads | mode | budget (GiB) | units kept | peak (GiB) | "
        "all-gathers per step |",
        "|---|---|---|--:|--:|--:|--:|",
    ]
    groups: dict[tuple[str, str], list[tuple[float, dict]]] = {}
    for row in rows:
        fraction = _fraction(row["label"])
        if fraction is None or not row["ok"]:
            continue
        sync = row["label"].partition(":")[2]
        groups.setdefault((row["backend"], sync), []).append((fraction, row))
    for (backend, sync), found in groups.items():
        fits = [(f, r) for f, r in sorted(found, key=lambda x: x[0]) if r["peak_bytes"] <= gpu_memory]
        if not fits:
            lines.append(f"| {backend} | {sync} | none fits | | | | |")
            continue
        fraction, row = fits[-1]
        budget = int(fraction * unsharded)
        kept = kept_count(units, budget)
        gathers = all_gathers(units, budget, frees_after_forward=True)
        lines.append(
            f"| {backend} | {sync} | `{row['label']}` | {budget / gib:.1f} | "
            f"{kept} of {len(units)} | {row['peak_bytes'] / gib:.1f} | {gathers} |"
        )
    return "\n".join(lines) + "\n"
