"""Which backward all-gathers were prefetched, from one step's timeline.

[Note: how the report counts prefetched all-gathers]
In the counting step a dispatch mode records every all-gather (its output size)
and a gradient hook marks each unit when the first module of its backward is
done: the output embedding for the root, each decoder layer's last ``Linear``.
That moment is after the unit's pre-backward hook (where FSDP issues its own
all-gather if it was not prefetched, and prefetches the next unit's) and
before the next unit's. With the units in backward order ``u_0`` (the root),
``u_1`` (the last layer), ..., and ``a_i = 1`` for the units a pass gathers,
``u_i`` (``i >= 1``) was prefetched when at ``u_{i-1}``'s mark the pass had
issued at least ``a_0 + ... + a_i`` all-gathers; without prefetch it has
issued ``a_0 + ... + a_{i-1}``. Which units a pass gathers is read from the
sizes: the root's all-gather differs in size from a layer's, and the layers
gathered are the first ones in forward order (a ``keep_unsharded`` budget keeps
the units nearest the output, so with equal layers it keeps the last ones).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

# Timeline events: ("ag", numel), ("mark", unit index), ("pass", None) opens a
# backward pass, ("gap", None) closes it (a second forward follows).
Event = tuple[str, Any]


def _numel(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return int(getattr(value, "numel", lambda: 0)())


def _all_gathers(events: list[Event]) -> Any:
    """A ``TorchDispatchMode`` that appends each c10d all-gather to ``events``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllGathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith("c10d.") and "allgather" in name.replace("_", ""):
                events.append(("ag", _numel(args[0]) if args else 0))
            return func(*args, **(kwargs or {}))

    return AllGathers()


def _first_in_backward(layer) -> Any:
    """The module whose backward runs first in a decoder layer: its last ``Linear``."""
    import torch

    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    return linears[-1]


class PrefetchTimeline:
    """Records all-gathers and unit marks for one step (see the note above).

    ``mark(name)`` takes the step's phase names: a pass starts at
    ``backward1_start`` and at ``backward1_end``; ``two_forward``'s second forward
    (``forward2_start`` to ``forward2_end``) is no pass.
    """

    def __init__(self, model, layers) -> None:
        self.events: list[Event] = []
        # Units in backward order: the root, then the layers last to first.
        self.firsts = [model.get_output_embeddings()] + [
            _first_in_backward(layer) for layer in list(layers)[::-1]
        ]

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        handles = [
            module.register_forward_hook(self._hook_input(index))
            for index, module in enumerate(self.firsts)
        ]
        try:
            with _all_gathers(self.events):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook_input(self, index: int):
        def forward_hook(module, args, output) -> None:
            for arg in args:
                if getattr(arg, "requires_grad", False):
                    arg.register_hook(lambda grad: self.events.append(("mark", index)))
                    return

        return forward_hook

    def mark(self, name: str) -> None:
        if name in ("backward1_start", "backward1_end", "forward2_end"):
            self.events.append(("pass", None))
        elif name == "forward2_start":
            self.events.append(("gap", None))

    def counts(self) -> tuple[int, int]:
        """(prefetched, could be prefetched) over every backward pass of the step."""
        return prefetch_counts(self.events, len(self.firsts))


def prefetch_counts(events: list[Event], units: int) -> tuple[int, int]:
    """(prefetched, could be prefetched) backward all-gathers in a timeline of
    ``units`` units (the root and the layers), as the note above defines them."""
    passes: list[list[Event]] = []
    current: list[Event] | None = None
    for event in events:
        if event[0] == "pass":
            current = []
            passes.append(current)
        elif event[0] == "gap":
            current = None
        elif current is not None:
            current.append(event)
    first_pass = next((i for i, e in enumerate(events) if e[0] in ("pass", "gap")), len(events))
    forward_sizes = Counter(size for kind, size in events[:first_pass] if kind == "ag")
    layer_size = forward_sizes.most_common(1)[0][0] if forward_sizes else None
    prefetched = candidates = 0
    for pass_events in passes:
        p, c = _pass_counts(pass_events, units, layer_size)
        prefetched += p
        candidates += c
    return prefetched, candidates


def _pass_counts(events: list[Event], n: int, layer_size: int | None) -> tuple[int, int]:
    sizes = [size for kind, size in events if kind == "ag"]
    layers_gathered = sum(size == layer_size for size in sizes)
    root_gathered = len(sizes) > layers_gathered
    # u_0 the root; u_1..u_{n-1} the layers last to first; gathered: the last m of them.
    gathered = [root_gathered] + [i >= n - 1 - layers_gathered for i in range(n - 1)]
    issued, at_mark = 0, {}
    for kind, value in events:
        if kind == "ag":
            issued += 1
        elif value not in at_mark:
            at_mark[value] = issued
    prefetched = candidates = 0
    for i in range(1, n):
        if not gathered[i] or i - 1 not in at_mark:
            continue
        candidates += 1
        prefetched += at_mark[i - 1] >= sum(gathered[: i + 1])
    return prefetched, candidates
