"""The modes the report compares: one ``ModeSpec`` each, in ``MODES``.

Adding a mode is one entry in ``MODES`` (and, if it runs its backward passes
differently, a branch in ``_step.train_step``); the CLI, the rows, the bounds
and the output follow from the entry.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

BACKWARDS = 2  # backward passes per step; passed to the library as ``backwards``
# The memory bounds: the most a mode may add over the two_forward peak.
KEEP_SLACK = 0.10  # keep and the budget modes: the bytes they hold unsharded, plus this share
REGATHER_SLACK = 0.05  # regather: this share of the two_forward peak
KEEP_SLACK_TEXT = f"{KEEP_SLACK:+.0%}"  # "+10%"
REGATHER_SLACK_TEXT = f"{REGATHER_SLACK:.0%}"  # "5%"

# (sync_grads, two_forward peak bytes, unsharded param bytes, reshard_to) -> (bound bytes, why)
Bound = Callable[[str | None, int, int, int | None], tuple[int, str]]


def _keep_bound(sync_grads: str | None, baseline_peak: int, unsharded: int,
                reshard_to: int | None) -> tuple[int, str]:
    # sync_grads="last" also holds the unsharded grads of all units until the last backward.
    if sync_grads == "last":
        return (int((1 + KEEP_SLACK) * 2 * unsharded),
                f"unsharded params + unsharded grads of all units {KEEP_SLACK_TEXT}")
    return int((1 + KEEP_SLACK) * unsharded), f"unsharded params of all units {KEEP_SLACK_TEXT}"


def _budget_bound(fraction: float) -> Bound:
    def bound(sync_grads: str | None, baseline_peak: int, unsharded: int,
              reshard_to: int | None) -> tuple[int, str]:
        budget = int(fraction * unsharded)
        what = f"budget ({fraction:.0%} of unsharded params)"
        if sync_grads == "last":
            return (int((1 + KEEP_SLACK) * (budget + unsharded)),
                    f"{what} + unsharded grads {KEEP_SLACK_TEXT}")
        return int((1 + KEEP_SLACK) * budget), f"{what} {KEEP_SLACK_TEXT}"

    return bound


def _accumulate_bound(sync_grads: str | None, baseline_peak: int, unsharded: int,
                      reshard_to: int | None) -> tuple[int, str]:
    # Gradient sync is off for micro-batch 1: its unsharded grads wait for micro-batch 2.
    return (int((1 + KEEP_SLACK) * 2 * unsharded),
            f"unsharded params + unsharded grads of all units {KEEP_SLACK_TEXT}")


def _ddp_bound(sync_grads: str | None, baseline_peak: int, unsharded: int,
               reshard_to: int | None) -> tuple[int, str]:
    # DDP keeps nothing (every rank holds the whole model and its gradients in both
    # modes): the block adds the flat copy of every bucket it all-reduces, all launched
    # before the first is waited on ([Note: how the block reduces DDP gradients]).
    return (int((1 + KEEP_SLACK) * unsharded),
            f"DDP: the block's flat copy of every bucket (the grads) {KEEP_SLACK_TEXT}")


def _regather_bound(sync_grads: str | None, baseline_peak: int, unsharded: int,
                    reshard_to: int | None) -> tuple[int, str]:
    return int(REGATHER_SLACK * baseline_peak), f"{REGATHER_SLACK_TEXT} of two_forward peak"


def _node_bound(sync_grads: str | None, baseline_peak: int, unsharded: int,
                reshard_to: int | None) -> tuple[int, str]:
    # Between passes each rank also holds 1/reshard_to of the unsharded parameters, and
    # a re-gather from them copies the unit's 1/reshard_to into its all-gather input
    # (at most as much again) before it frees it.
    assert reshard_to, "regather_node rows pass reshard_to"
    return (int(REGATHER_SLACK * baseline_peak + (1 + KEEP_SLACK) * 2 * unsharded / reshard_to),
            f"{REGATHER_SLACK_TEXT} of two_forward peak + 2/{reshard_to} of the unsharded "
            f"params {KEEP_SLACK_TEXT}")


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """How one mode runs a step, and what it promises about memory.

    ``block``: the options of ``no_reshard_between_backwards`` (``None``: the
    mode runs without the library); ``sync_grads``: the ``:<sync_grads>``
    suffixes the mode takes, the first is the default; ``forwards``: forward
    passes per step; ``bound``: the most memory the mode may add over
    ``two_forward``; ``probe``: backward 1 is a probe pass
    (``block.backward(loss, param_grads=False)``); ``budget``: ``keep_unsharded``
    is this fraction of the model's unsharded parameter bytes (a byte budget);
    ``expected_crash``: backend -> why this mode is expected to fail there (its
    row then records the crash and does not count as a failed row); ``step``:
    how ``_step.train_step`` runs it when not the plain one forward and
    ``BACKWARDS`` passes: ``"recipe"`` (FSDP2 alone, see ``_fsdp2_steps.py``),
    ``"accumulate"`` (two micro-batches of gradient accumulation, each in a
    block), ``"accumulate_gathered"`` (the same with the user's
    ``set_reshard_after_backward(False)``); ``short_what``: ``what`` in the plot's
    legend; ``fsdp2_only``: the mode calls FSDP2's own methods, so on other backends
    its row is not applicable (recorded as an expected ``ValueError``); ``node_groups``:
    the block's ``reshard_to`` is the report's ``--node-size`` (``Mode.reshard_to``);
    ``not_applicable``: backend -> why the mode means nothing there (on DDP, which
    shards nothing, the modes that differ from ``keep`` only in ``keep_unsharded`` or
    ``reshard_to``): its row is not run and records the reason as expected.
    ``passes``: backward passes over the forward (1: one backward of the two losses'
    sum, what a step that needs no second pass runs; ``one_pass`` against
    ``one_backward`` is the block's own cost there, ``add_one_pass_comparisons``).
    """

    name: str
    what: str
    block: dict[str, Any] | None = None
    sync_grads: tuple[str, ...] = ()
    forwards: int = 1
    bound: Bound | None = None
    probe: bool = False
    budget: float | None = None
    expected_crash: dict[str, str] = dataclasses.field(default_factory=dict)
    step: str | None = None
    short_what: str | None = None  # ``what`` in the plot's legend, if shorter
    fsdp2_only: bool = False
    node_groups: bool = False
    not_applicable: dict[str, str] = dataclasses.field(default_factory=dict)
    passes: int = BACKWARDS

    def __post_init__(self) -> None:
        crashes = {**self.not_applicable, **self.expected_crash}
        if self.fsdp2_only:
            crashes = {**_fsdp2_only(self.name), **crashes}
        object.__setattr__(self, "expected_crash", crashes)

    def applies_to(self, backend: str) -> bool:
        """False for an FSDP2-only mode on another backend, or a mode ``not_applicable``
        on ``backend`` (its row is n/a there)."""
        return backend not in self.not_applicable and (not self.fsdp2_only or backend == "fsdp2")

    def bound_on(self, backend: str) -> Bound | None:
        """``bound``; on DDP, where nothing is kept, the block's reduction copies."""
        return _ddp_bound if backend == "ddp" and self.bound is not None else self.bound


def _fsdp2_only(mode: str) -> dict[str, str]:
    why = f"{mode} calls FSDP2's own methods (FSDPModule): an FSDP2-only mode"
    return {"fsdp1": why, "deepspeed": why, "ddp": why}


# On DDP every rank holds the whole model: nothing to keep, re-gather or reshard.
_NOTHING_SHARDED = ("DDP shards nothing: keep_unsharded has no effect there (False and "
                    "byte budgets behave as True), so this row would repeat keep's; not run")


MODES: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        ModeSpec("two_forward", "forward, backward, forward again, backward (no library)",
                 forwards=2),
        ModeSpec("naive", "one forward, backward(retain_graph=True), backward (no library)",
                 expected_crash={
                     "fsdp1": "plain FSDP1 frees the unsharded parameters the retained graph "
                              "still uses after backward 1 (setStorage ... storage of size 0); "
                              "the crash the library removes",
                     "deepspeed": "plain ZeRO-3 releases the parameters the retained graph "
                                  "still uses after backward 1 (size of tensor a (0)); the "
                                  "crash the library removes",
                     "ddp": "plain DDP runs but is silently wrong: it all-reduces only the "
                            "first backward over a forward (pytorch #47260), so backward 2's "
                            "gradients stay local to each rank and the ranks' gradients "
                            "disagree (the replica check fails); the error the library "
                            "removes, not an alternative",
                 }),
        ModeSpec("one_backward", "one forward, one backward of the two losses' sum (no "
                 "library): a step that needs no second pass", passes=1),
        ModeSpec("one_pass", "the library, keep_unsharded=True, one backward of the two "
                 "losses' sum: the block around a step that needs no second pass",
                 block=dict(keep_unsharded=True), sync_grads=("every",), bound=_keep_bound,
                 passes=1, short_what="one pass in the block"),
        ModeSpec("keep", "the library, keep_unsharded=True",
                 block=dict(keep_unsharded=True), sync_grads=("every", "last"),
                 bound=_keep_bound),
        ModeSpec("probe", "the library, keep_unsharded=True; backward 1 is a probe pass "
                 "(param_grads=False: hooks only, no parameter gradients)",
                 block=dict(keep_unsharded=True), sync_grads=("every", "last"),
                 bound=_keep_bound, probe=True),
        ModeSpec("check", "the library, keep_unsharded=True, check_saved_tensors=True",
                 block=dict(keep_unsharded=True, check_saved_tensors=True),
                 sync_grads=("every", "last"), bound=_keep_bound),
        ModeSpec("regather", "the library, keep_unsharded=False",
                 block=dict(keep_unsharded=False), sync_grads=("every", "last"),
                 bound=_regather_bound, not_applicable={"ddp": _NOTHING_SHARDED}),
        ModeSpec("regather_node", "the library, keep_unsharded=False, reshard_to=<--node-size>: "
                 "between passes each unit is resharded to the ranks of one node, so the "
                 "later passes all-gather inside the node",
                 block=dict(keep_unsharded=False), sync_grads=("every", "last"),
                 bound=_node_bound, node_groups=True,
                 expected_crash={
                     "fsdp1": "reshard_to needs FSDP2 (fully_shard) or FSDP1 HYBRID_SHARD with "
                              "shard groups of one node (--fsdp1-sharding HYBRID_SHARD): the "
                              "library refuses it on FSDP1 FULL_SHARD",
                     "deepspeed": "reshard_to needs FSDP2 (fully_shard): the library refuses "
                                  "it on ZeRO-3"},
                 not_applicable={"ddp": "DDP shards nothing: the library refuses reshard_to "
                                        "there, and keep_unsharded=False behaves as True; "
                                        "not run"}),
        *(
            ModeSpec(f"keep{pct}", f"the library, keep_unsharded=<{pct}% of the unsharded "
                     "parameter bytes> (a byte budget: the units nearest the output kept)",
                     block={}, sync_grads=("every", "last"),
                     bound=_budget_bound(pct / 100), budget=pct / 100,
                     not_applicable={"ddp": _NOTHING_SHARDED})
            for pct in (25, 50, 75)
        ),
        ModeSpec("fsdp2_recipe", "FSDP2 alone, the recipe of pytorch #172543: "
                 "set_reshard_after_forward(False) and set_reshard_after_backward(False) on "
                 "every unit, both backwards, reshard() of every unit after the last",
                 sync_grads=("every", "last"), bound=_keep_bound,
                 fsdp2_only=True, step="recipe",
                 short_what="FSDP2 alone (pytorch #172543)"),
        ModeSpec("accum", "two micro-batches of gradient accumulation (the step's batch "
                 "twice; gradient sync off for the first), each a block with "
                 "keep_unsharded=True and its two backwards; FSDP2 reshards after each",
                 block=dict(keep_unsharded=True), sync_grads=("every", "last"),
                 bound=_accumulate_bound, fsdp2_only=True,
                 step="accumulate", short_what="2 micro-batches"),
        ModeSpec("accum_gathered", "as accum, with the user's set_reshard_after_backward(False) "
                 "on every unit (parameters stay gathered across micro-batches) and the "
                 "user's reshard() of every unit after the last micro-batch",
                 block=dict(keep_unsharded=True), sync_grads=("every", "last"),
                 bound=_accumulate_bound, fsdp2_only=True,
                 step="accumulate_gathered",
                 short_what="2 micro-batches, the user's set_reshard_after_backward(False)"),
    )
}
# Library rows compared with the recipe (``add_recipe_comparisons``): mode -> the recipe.
RECIPE = "fsdp2_recipe"
DEFAULT_MODES = ("two_forward", "naive", "keep:every", "keep:last", "probe:every",
                 "check:every", "regather:every")
# Modes whose timed steps also stamp their phases (backward 1, forward 2).
MARKED_MODES = ("two_forward", "keep", "probe")


def mode_legend(label: str, *, short: bool = False, node_size: int | None = None) -> str:
    """What a mode label means, e.g. ``keep:last`` -> the library call with its options;
    ``short``: the options only (for the plot); ``node_size``: the report's ``--node-size``."""
    mode = Mode.parse(label, node_size=node_size)
    what = (mode.spec.short_what if short else None) or mode.spec.what
    if not mode.uses_library:
        if mode.spec.step == "recipe" and mode.sync_grads == "last":
            return what + "; set_requires_gradient_sync(False) for backward 1"
        return what
    budget = mode.spec.budget
    options: dict[str, object] = {
        key: value for key, value in mode.block_options(0 if budget is not None else None).items()
        if not (short and key == "backwards")
    }
    if budget is not None:
        options["keep_unsharded"] = f"<{budget:.0%} of the unsharded parameter bytes>"
    if mode.spec.node_groups and mode.reshard_to is None:
        options["reshard_to"] = "<--node-size>"
    prefix = f"{what}: " if mode.spec.step else ""
    text = ", ".join(
        f"{key}={value}" if not isinstance(value, str) or value.startswith("<")
        else f'{key}="{value}"'
        for key, value in options.items()
    )
    if not short:
        text = f"no_reshard_between_backwards(model, {text})"
    text = prefix + text
    if mode.spec.probe:
        text += ("; backward 1 a probe pass" if short
                 else "; backward 1 is a probe pass, block.backward(loss, param_grads=False)")
    if mode.spec.passes == 1:
        text += "; one backward of the two losses' sum"
    return text


# A mode as the README's cost table names it (scripts/docs_figures.py, COST_TABLES["readme"],
# without its backticks): the option that differs from the defaults. The figures' legends
# use these; other modes fall back to their options (``mode_legend(short=True)``).
OPTION_TEXTS: dict[str, str] = {
    "two_forward": "two forwards (baseline)",
    "naive": "plain retain_graph=True (no library)",
    "keep:every": "defaults",
    "keep:last": 'sync_grads="last"',
    "probe:every": "backward 1 a probe pass",
    "check:every": "check_saved_tensors=True",
    "regather:every": "keep_unsharded=False",
    "regather_node:every": "keep_unsharded=False, reshard_to=<ranks per node>",
    **{f"keep{pct}:every": f"keep_unsharded=<{pct}% of the bytes>" for pct in (25, 50, 75)},
    "fsdp2_recipe:every": "FSDP2 alone, its recipe (pytorch #172543; no library)",
    "fsdp2_recipe:last": "FSDP2 alone, its recipe, gradient sync off for backward 1",
    "one_backward": "one backward of the sum (no library)",
    "one_pass:every": "one backward of the sum, in the block",
}


def option_text(label: str) -> str:
    """``keep:last`` -> ``sync_grads="last"``: the README's name for a mode (``OPTION_TEXTS``),
    else its options."""
    return OPTION_TEXTS.get(label) or mode_legend(label, short=True)


def mode_labels() -> list[str]:
    """Every label ``Mode.parse`` accepts, e.g. ``keep:last``."""
    return [f"{s.name}:{sync}" if s.sync_grads else s.name
            for s in MODES.values() for sync in (s.sync_grads or (None,))]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One mode with its ``sync_grads``; ``label`` is ``name[:sync_grads]``.

    ``budget_bytes``: ``keep_unsharded`` as these bytes (``fit`` simulates such budgets;
    label ``keep_unsharded=<bytes>:<sync_grads>``). ``reshard_to``: the block's
    ``reshard_to`` in a ``node_groups`` mode (the report's ``--node-size``).
    """

    name: str
    sync_grads: str | None = None
    budget_bytes: int | None = None
    reshard_to: int | None = None

    @classmethod
    def parse(cls, text: str, *, node_size: int | None = None) -> Mode:
        """``keep:last`` -> its ``Mode``; ``node_size`` becomes the ``reshard_to`` of a
        ``node_groups`` mode."""
        name, _, sync = text.partition(":")
        budget = re.fullmatch(r"keep_unsharded=(\d+)(?:,reshard_to=(\d+))?", name)
        if budget is not None and sync in ("", "every", "last"):
            # What fit prints: a budget in bytes, with --node-size its reshard_to.
            group = budget.group(2)
            return cls("keep", sync or "every", budget_bytes=int(budget.group(1)),
                       reshard_to=None if group is None else int(group))
        spec = MODES.get(name)
        reshard_to = node_size if spec is not None and spec.node_groups else None
        if spec is not None and not spec.sync_grads and not sync:
            return cls(name, reshard_to=reshard_to)
        if spec is not None and spec.sync_grads and (not sync or sync in spec.sync_grads):
            return cls(name, sync or spec.sync_grads[0], reshard_to=reshard_to)
        labels = mode_labels()
        raise ValueError(f"unknown mode {text!r}: use {', '.join(labels[:-1])} or {labels[-1]}")

    @property
    def spec(self) -> ModeSpec:
        return MODES[self.name]

    @property
    def label(self) -> str:
        name = self.name if self.budget_bytes is None else f"keep_unsharded={self.budget_bytes}"
        if self.reshard_to is not None and not self.spec.node_groups:
            name = f"{name},reshard_to={self.reshard_to}"  # fit's budgets with --node-size
        return name if self.sync_grads is None else f"{name}:{self.sync_grads}"

    @property
    def uses_library(self) -> bool:
        return self.spec.block is not None

    def block_options(self, unsharded_bytes: int | None = None) -> dict[str, Any]:
        """Keyword arguments of ``no_reshard_between_backwards`` for this mode
        (budget modes need the model's unsharded parameter bytes)."""
        assert self.spec.block is not None, self
        options = {**self.spec.block, "sync_grads": self.sync_grads,
                   "backwards": self.spec.passes}
        if self.budget_bytes is not None:
            options["keep_unsharded"] = self.budget_bytes
        elif self.spec.budget is not None:
            assert unsharded_bytes is not None, f"{self.label} needs the unsharded bytes"
            options["keep_unsharded"] = int(self.spec.budget * unsharded_bytes)
        if self.reshard_to is not None:
            options["reshard_to"] = self.reshard_to
        return options
