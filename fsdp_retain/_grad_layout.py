"""Which parameter each element of a per-loss gradient shard belongs to.

[Note: which parameters a per-loss gradient covers]
A ``LossGrads`` holds, per holder (FSDP2's sharded parameter, FSDP1's flat
parameter, a ZeRO-3 gradient partition), the rank's local shard of one loss's
gradient. A holder may mix parameters: FSDP1 flattens a unit's parameters into
one flat parameter, and with ``use_orig_params=True`` frozen ones (a LoRA base)
sit beside trainable ones. FSDP1 computes a gradient for the whole flat
parameter, frozen views included, and only hides it from the frozen
parameter's ``.grad``. So every reduction over a ``LossGrads`` goes through a
``Selection``: per holder, the ranges of the local shard that belong to the
parameters it covers. By default those are the trainable parameters (what
``torch.autograd.grad(loss, [p for p in model.parameters() if
p.requires_grad])`` covers on one process); ``LossGrads.select`` narrows it to
the parameters a method names (the shared trunk), by name, module or tensor.

A ``Layout`` is built once per ``GradSlots`` by the backend that knows its
holders: one ``Segment`` per parameter and holder, in the same order on every
rank (a parameter outside this rank's shard has an empty segment), so that
per-parameter reductions line up across ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter or module name without the wrappers' prefixes (FSDP1,
    activation checkpointing, ``torch.compile``), as state dicts show it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclasses.dataclass(frozen=True)
class Segment:
    """One parameter's elements in a holder's local (flattened) gradient shard."""

    name: str
    start: int
    stop: int
    trainable: bool
    aliases: tuple[str, ...] = ()  # tied names of the same parameter

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Per holder: ``None`` (nothing), or the covered ``(start, stop)`` ranges of
    its local shard; ``full[h]``: they cover the whole shard. ``names``: the
    covered parameters, in layout order."""

    ranges: tuple[tuple[tuple[int, int], ...] | None, ...]
    full: tuple[bool, ...]
    names: tuple[str, ...]

    def pieces(self, index: int, value: torch.Tensor) -> torch.Tensor | None:
        """The covered elements of holder ``index``'s local ``value`` (1-D)."""
        ranges = self.ranges[index]
        if ranges is None:
            return None
        flat = value.reshape(-1)
        if self.full[index]:
            return flat
        return torch.cat([flat[a:b] for a, b in ranges])

    def mask_into(self, index: int, target: torch.Tensor, value: torch.Tensor) -> None:
        """``target += value`` over the covered elements of holder ``index`` (1-D views)."""
        ranges = self.ranges[index]
        if ranges is None:
            return
        src = value.detach().reshape(-1).to(target.dtype)
        dst = target.view(-1)
        if self.full[index]:
            dst.add_(src)
            return
        for a, b in ranges:
            dst[a:b].add_(src[a:b])


class Layout:
    """The segments of every holder, and how names, modules and tensors map to them.

    ``root``: the module whose names the segments use (FSDP roots: clean names);
    ``tensors``: ``id`` of a parameter object the user may hold -> the names it
    stands for; ``flat``: ids of tensors that stand for several parameters at
    once (FSDP1's flat parameters with ``use_orig_params=False``).
    """

    def __init__(self, root: nn.Module, segments: list[list[Segment]], numels: list[int],
                 tensors: dict[int, tuple[str, ...]], flat: set[int] | None = None) -> None:
        self.root = root
        self.segments = segments
        self.numels = numels
        self.tensors = tensors
        self.flat = flat or set()
        self._by_name: dict[str, Segment] = {}
        for holder in segments:
            for seg in holder:
                for name in seg.names():
                    self._by_name.setdefault(name, seg)
        self.default = self._select(lambda seg: seg.trainable)

    def names(self) -> list[str]:
        return [seg.name for holder in self.segments for seg in holder]

    def resolve(self, params: Any) -> Selection:
        """The trainable parameters ``params`` names: parameter names (a module's
        name selects all of its parameters), modules, or parameters as the wrapped
        model's ``parameters()`` gives them. Frozen parameters a module or a
        parameter list brings along are left out; a frozen one named is refused."""
        wanted = self._wanted_names(params)
        chosen = {self._by_name[n].name for n in wanted if self._by_name[n].trainable}
        if not chosen:
            raise ValueError(
                f"params names only frozen parameters ({', '.join(sorted(wanted)[:3])}): "
                "they have no gradient to select. Name trainable ones."
            )
        return self.selection(chosen)

    def selection(self, names: set[str]) -> Selection:
        """The ranges of the parameters ``names`` (canonical names)."""
        return self._select(lambda seg: seg.name in names)

    def _wanted_names(self, params: Any) -> set[str]:
        items = [params] if isinstance(params, (str, nn.Module, torch.Tensor)) else list(params)
        if not items:
            raise ValueError("params is empty: name at least one parameter or module")
        wanted: set[str] = set()
        flats: list[Any] = []
        for item in items:
            if isinstance(item, str):
                name = clean_name(item)
                seg = self._by_name.get(name)
                if seg is not None and not seg.trainable:
                    raise ValueError(
                        f"params names the frozen parameter {item!r}: it has no gradient to "
                        "select. Leave it out (a module's name selects its trainable ones)."
                    )
                wanted |= self._by_prefix(name, item)
            elif isinstance(item, nn.Module):
                wanted |= self._by_prefix(self._module_name(item), type(item).__name__)
            elif isinstance(item, torch.Tensor):
                names = self.tensors.get(id(item))
                if names is None:
                    raise ValueError(
                        f"params holds a tensor of shape {tuple(item.shape)} that is not a "
                        "parameter of this model as the block sees it (parameters taken "
                        "before wrapping are replaced by FSDP). Pass the wrapped model's "
                        "parameters, the submodule, or parameter names."
                    )
                if id(item) in self.flat:
                    flats.append(item)
                wanted |= set(names)
        if flats and len({id(f) for f in flats}) != len(self.flat):
            raise ValueError(
                "params holds some of FSDP1's flat parameters (use_orig_params=False): a "
                "submodule's parameters() then gives the flat parameters of the FSDP units "
                "inside it, not the module's own parameters, so the selection would "
                "silently miss those in enclosing units. Pass the submodule itself "
                "(params=model.trunk) or parameter names."
            )
        return wanted

    def _by_prefix(self, prefix: str, what: str) -> set[str]:
        found = {n for n in self._by_name if n == prefix or n.startswith(prefix + ".")
                 or prefix == ""}
        if not found:
            known = ", ".join(self.names()[:4])
            raise ValueError(
                f"params names {what!r}, which matches no parameter of this model (its "
                f"parameters are named like {known}, ...)"
            )
        return found

    def _module_name(self, module: nn.Module) -> str:
        for name, m in self.root.named_modules():
            if m is module:
                return clean_name(name)
        raise ValueError(
            f"params holds a {type(module).__name__} that is not a submodule of the "
            "model this block was given: pass a submodule of it, or parameter names"
        )

    def _select(self, keep: Any) -> Selection:
        ranges: list[tuple[tuple[int, int], ...] | None] = []
        full: list[bool] = []
        names: list[str] = []
        for holder, numel in zip(self.segments, self.numels):
            spans: list[tuple[int, int]] = []
            for seg in holder:
                if not keep(seg):
                    continue
                names.append(seg.name)
                if seg.stop <= seg.start:
                    continue
                if spans and spans[-1][1] == seg.start:
                    spans[-1] = (spans[-1][0], seg.stop)
                else:
                    spans.append((seg.start, seg.stop))
            ranges.append(tuple(spans) if spans else None)
            full.append(spans == [(0, numel)])
        return Selection(tuple(ranges), tuple(full), tuple(names))


def tensor_names(module: nn.Module) -> dict[int, tuple[str, ...]]:
    """``id`` of each parameter of ``module`` -> its clean names (tied ones: several)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(clean_name(name))
    return {k: tuple(v) for k, v in names.items()}


def per_param_layout(root: nn.Module, params: list[Any], numels: list[int] | None = None) -> Layout:
    """One segment per holder, the parameter itself (FSDP2's sharded parameters; a
    ZeRO-3 partition per parameter, ``numels`` its local length); names from ``root``."""
    names = tensor_names(root)
    segments, sizes = [], []
    for index, param in enumerate(params):
        local = getattr(param, "_local_tensor", param)
        numel = local.numel() if numels is None else numels[index]
        found = names.get(id(param), (f"<parameter {index}>",))
        segments.append([Segment(found[0], 0, numel, bool(param.requires_grad), found[1:])])
        sizes.append(numel)
    return Layout(root, segments, sizes, names)
