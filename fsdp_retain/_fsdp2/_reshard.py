"""Where each FSDP2 parameter group goes between passes: the block's per-group flags,
resharding to groups of ranks (``reshard_to``), which parameters the modules of a
group kept unsharded show (``ShownParams``), and where a probe pass leaves each group
(``ProbeRecord``).

Part of the FSDP2 backend with ``_block.py`` (private FSDP2 access).

[Note: resharding to groups of ranks between passes]
FSDP2 built with ``reshard_after_forward=<int>`` reshards a parameter group after
forward to a smaller mesh, its ``post_forward_mesh_info``: each rank keeps 1/N of the
unsharded parameters, the N ranks of its group together all of them, so the
backward's all-gather stays inside the group. FSDP2's post-backward reshard always
goes to the whole mesh, so a second pass over a retained graph would all-gather over
every rank. Between the passes of a block, each group the budget does not keep
(``Policy.kept``) is resharded the post-forward way instead, to
``Policy.between_passes_ranks`` ranks: the block sets the group's ``reshard`` (an
instance attribute, removed at uninstall) to ``GroupReshard._reshard``, which in a
post-backward that does not free (``Policy.regroups``) puts the group mesh in place
and calls FSDP2's ``_to_sharded_post_forward``; the modules then show the sharded
parameters, as between any two passes. The next pass's all-gather reads
``post_forward_mesh_info``, the group's process group. In a forward the owner's
own post-forward mesh is in place (what FSDP2 does after forward is unchanged); in
the last announced pass, at the block exit and outside a backward FSDP2's own
``reshard`` runs (to the whole mesh); reduce-scatters never change. For a group
built with a bool ``reshard_after_forward`` the group mesh is made as FSDP2 makes
its own, once per group and ``ranks`` (a ``DeviceMesh`` creates process groups:
every rank installs the block at the same point), and kept on the group.

[Note: a probe pass leaves each group as it found it]
A probe pass changes no gradient (see [Note: probe passes] in ``_common.py``), so it
must not change which tensor the modules show for a parameter either: that tensor's
``.grad`` is what ``model.parameters()`` reads. FSDP2 shows a group's unsharded
parameters while it is unsharded (after a forward, and after a backward that did not
reshard); under ``set_requires_gradient_sync(False)`` their ``.grad`` holds the
gradients the earlier micro-batches accumulated, which the sharded parameters do not
have. The block shows the sharded ones between passes (``ShownParams``), so a probe
pass that runs first, between the forward and the first normal pass, would end with
the sharded parameters shown and ``.grad`` reading ``None``. A ``ProbeRecord`` per
group notes at the probe's start (before the pass start shows the unsharded
parameters) which of its ``FSDPParam``'s tensors each module shows, and the pass's
reduce flags once the pass starts; at the pass end, after the block's own swap, it puts
the flags back and shows those tensors again, each where it still holds data: the
sharded parameter always, the unsharded one while the group is unsharded, the
post-forward shard while the group is resharded to it. A group the budget does not
keep is freed by the pass, as by any pass (``keep_unsharded=False`` promises no memory
between passes): its modules show the sharded parameters, and where they showed a
gradient before, the block warns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._common import compiling, is_compiled_in_place, require_attrs, warn_once
from ._compat import FLAVOUR, post_forward_mesh_info, training_state_enum
from .._policy import Policy

_MISSING = object()
# What FSDP2 keeps per parameter for its post-forward mesh (set at fully_shard when
# reshard_after_forward is not False).
_PARAM_MESH_ATTRS = (
    "post_forward_mesh_info",
    "sharded_post_forward_size",
    "contiguous_sharded_post_forward_stride",
)
_PARAM_ATTRS = ("_init_sharded_post_forward_param_metadata", "_orig_size")
_GROUP_ATTRS = ("_to_sharded_post_forward", "_to_sharded", "is_sharded_post_forward",
                "_training_state", "mesh_info")
# The FSDPParam attributes whose tensor its modules may show, with the group property
# true while that tensor holds data (None: always).
_SHOWABLE = {
    "sharded_param": None,
    "_unsharded_param": "is_unsharded",
    "_sharded_post_forward_param": "is_sharded_post_forward",
}
_MESHES_ATTR = "_fsdp_retain_group_meshes"  # on a group: {ranks: its mesh info}
_PARAM_META_ATTR = "_fsdp_retain_group_meta"  # on an FSDPParam: {ranks: its metadata}


class ShownParams:
    """Between passes the modules of a group kept unsharded show its sharded parameters,
    as after a plain backward (``model.parameters()``, ``zero_grad()``,
    ``clip_grad_norm_``); from the next pass, or a forward, the unsharded ones again."""

    def __init__(self, groups: list[Any]) -> None:
        self._groups = groups  # the block's list, filled at install
        self.swapped: set[int] = set()  # ids of the groups showing sharded parameters

    def show_sharded(self) -> None:
        for group in self._groups:
            if group.is_unsharded and id(group) not in self.swapped:
                for fsdp_param in group.fsdp_params:
                    fsdp_param._setattr_on_modules(fsdp_param.sharded_param)
                self.swapped.add(id(group))

    def show_unsharded(self, group: Any = None) -> None:
        """Every group (or ``group`` only) shows its unsharded parameters again."""
        if not self.swapped:
            return  # a forward's pre-hook on each module of a kept group asks
        for each in self._groups if group is None else [group]:
            if id(each) in self.swapped:
                for fsdp_param in each.fsdp_params:
                    fsdp_param._setattr_on_modules(fsdp_param._unsharded_param)
                self.swapped.discard(id(each))

    def put(self, group: Any, shown: list[str | None]) -> bool:
        """``group``'s modules show again the tensors ``shown`` names (``shown_attrs``)
        where they still hold data; False where one does not (the group was freed
        since), whose modules keep what FSDP2 set."""
        whole = True
        for fsdp_param, name in zip(group.fsdp_params, shown):
            tensor = _showable(group, fsdp_param, name)
            if tensor is None:
                whole = whole and name is None
            elif _module_param(fsdp_param) is not tensor:
                fsdp_param._setattr_on_modules(tensor)
        if group.is_unsharded and any(
            _module_param(fp) is fp.sharded_param for fp in group.fsdp_params
        ):
            self.swapped.add(id(group))
        else:
            self.swapped.discard(id(group))
        return whole

    def hook_forwards(self, kept: set[int]) -> list[Any]:
        """A forward between passes of a kept group's module shows the unsharded
        parameters first."""
        handles = []
        for group in self._groups:
            if id(group) in kept:
                for module in group.modules:
                    if not is_compiled_in_place(module):  # it shows what FSDP2 set up
                        handles.append(module.register_forward_pre_hook(
                            self._before_forward, prepend=True))
        return handles

    def _before_forward(self, module: Any, args: Any) -> None:
        if not compiling():
            self.show_unsharded()


def _module_param(fsdp_param: Any) -> Any:
    info = fsdp_param._module_info
    return getattr(info.module, info.param_name)


def _showable(group: Any, fsdp_param: Any, name: str | None) -> Any:
    """The tensor ``fsdp_param.<name>`` if it holds data now, else None."""
    if name is None:
        return None
    state = _SHOWABLE[name]
    if state is not None and not getattr(group, state):
        return None
    return getattr(fsdp_param, name, None)


def shown_attrs(group: Any) -> list[str | None]:
    """Per FSDP parameter of ``group``, the attribute holding the tensor its modules
    show (None: none of them, e.g. a tensor the user set)."""
    found = []
    for fsdp_param in group.fsdp_params:
        shown = _module_param(fsdp_param)
        found.append(next(
            (name for name in _SHOWABLE if getattr(fsdp_param, name, None) is shown), None
        ))
    return found


class ProbeRecord:
    """One parameter group as a probe pass found it; see [Note: a probe pass leaves
    each group as it found it]."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.shown = shown_attrs(group)
        self.showed_grad = any(_module_param(fp).grad is not None for fp in group.fsdp_params)
        self.flags: tuple[bool, bool] | None = None  # at the pass start

    def start(self) -> None:
        """The pass starts: it reduces nothing (held-back gradients stay pending)."""
        group = self.group
        self.flags = (group.reduce_grads, group.all_reduce_grads)
        group.reduce_grads = False
        group.all_reduce_grads = False

    def end(self, shown: ShownParams) -> bool:
        """Puts back the flags and what the modules showed; False where the group was
        freed since and its modules showed a gradient, which they no longer show."""
        if self.flags is not None:
            self.group.reduce_grads, self.group.all_reduce_grads = self.flags
            self.flags = None
        return shown.put(self.group, self.shown) or not self.showed_grad


def set_group_flags(groups: list[Any], kept: set[int], holds_back: bool) -> None:
    """The flags of ``_block.py``'s docstring: kept groups stay unsharded from the
    forward through every pass; the others reshard after each backward."""
    for group in groups:
        if id(group) in kept:
            group.post_forward_mesh_info = None
            group.reshard_after_backward = False
        else:
            group.reshard_after_backward = True
        if holds_back:
            group.reduce_grads = False
            group.all_reduce_grads = False


class _Mesh:
    """A group's post-forward mesh with its per-parameter metadata."""

    def __init__(self, info: Any, params: list[tuple[Any, ...]]) -> None:
        self.info, self.params = info, params

    @classmethod
    def capture(cls, group: Any) -> _Mesh:
        return cls(group.post_forward_mesh_info, [
            tuple(getattr(fp, name, _MISSING) for name in _PARAM_MESH_ATTRS)
            for fp in group.fsdp_params
        ])

    def apply(self, group: Any) -> None:
        group.post_forward_mesh_info = self.info
        for fsdp_param, values in zip(group.fsdp_params, self.params):
            for name, value in zip(_PARAM_MESH_ATTRS, values):
                if value is _MISSING:
                    fsdp_param.__dict__.pop(name, None)
                else:
                    setattr(fsdp_param, name, value)


class GroupReshard:
    """One parameter group resharded to groups of ranks between passes; see
    [Note: resharding to groups of ranks between passes]."""

    def __init__(self, group: Any, between: _Mesh, freeing: Callable[[], bool]) -> None:
        self.group, self.between, self._freeing = group, between, freeing
        self.owner = _Mesh.capture(group)
        self._states = training_state_enum()
        group.reshard = self._reshard

    def _reshard(self) -> None:
        group, states = self.group, self._states
        if group._training_state == states.POST_BACKWARD and Policy.regroups(
            freeing=self._freeing()
        ):
            if group.is_unsharded:
                self.between.apply(group)
                group._to_sharded_post_forward()
                for fsdp_param in group.fsdp_params:
                    fsdp_param._setattr_on_modules(fsdp_param.sharded_param)
            return  # already sharded: nothing to gather from
        if group._training_state == states.FORWARD and group.is_unsharded:
            self.owner.apply(group)
        type(group).reshard(group)

    def uninstall(self) -> None:
        group = self.group
        group.__dict__.pop("reshard", None)
        if group.is_sharded_post_forward:  # an exit that did not reshard: a local step
            group._to_sharded()
        self.owner.apply(group)
        if group.is_sharded:
            for fsdp_param in group.fsdp_params:
                # FSDP2's full reshard leaves the post-forward copy referenced.
                fsdp_param._sharded_post_forward_param = None
                fsdp_param._sharded_post_forward_param_data = None


class BetweenPasses:
    """The groups of one block resharded to groups of ranks between passes."""

    def __init__(self) -> None:
        self._records: list[GroupReshard] = []

    def install(self, groups: list[Any], kept: set[int], policy: Policy,
                freeing: Callable[[], bool]) -> None:
        set_group_flags(groups, kept, policy.holds_back)
        loose = [g for g in groups if id(g) not in kept]
        built = {_built_with(g) for g in groups} - {None}
        default = built.pop() if len(built) == 1 else None
        # Group meshes already made (FSDP2's own, earlier blocks'): one per mesh and size.
        known = {(id(g.mesh_info.mesh), _built_with(g)): g.post_forward_mesh_info
                 for g in groups if _built_with(g) is not None}
        for group in groups:
            for ranks, info in group.__dict__.get(_MESHES_ATTR, {}).items():
                known.setdefault((id(group.mesh_info.mesh), ranks), info)
        for group in loose:
            ranks = policy.between_passes_ranks(_built_with(group) or default)
            if ranks is None:
                continue
            between = _between_mesh(group, ranks, known, policy.options.reshard_to)
            if between is not None:
                self._records.append(GroupReshard(group, between, freeing))

    def uninstall(self) -> None:
        for record in self._records:
            record.uninstall()
        self._records.clear()


def _built_with(group: Any) -> int | None:
    """The ranks FSDP2 reshards ``group`` to after forward when fewer than its mesh's
    (``reshard_after_forward=<int>``), else ``None``."""
    size = getattr(group.post_forward_mesh_info, "shard_mesh_size", None)
    whole = getattr(group.mesh_info, "shard_mesh_size", None)
    return size if size is not None and size != whole else None


def _between_mesh(group: Any, ranks: int, known: dict, asked: int | None) -> _Mesh | None:
    """``group``'s mesh of ``ranks`` ranks with each parameter's metadata for it; ``None``
    when ``ranks`` is its whole shard group. Raises where FSDP2 cannot reshard there."""
    shard = getattr(group.mesh_info, "shard_mesh_size", None)
    if shard is None or ranks == shard:
        if shard is not None and asked is not None:
            warn_once(f"no_reshard_between_backwards(reshard_to={asked}) has no effect: "
                      f"FSDP2 shards each parameter over {shard} ranks already.")
        return None  # replicated (nothing sharded), or every rank: a plain reshard
    if shard % ranks:
        raise ValueError(
            f"no_reshard_between_backwards(reshard_to={asked}): {ranks} does not divide "
            f"the {shard} ranks FSDP2 shards each parameter over (its mesh's shard "
            "dimension). Pass a divisor of that, such as the GPUs of one node, or "
            "reshard_to=None."
        )
    require_attrs(group, _GROUP_ATTRS, FLAVOUR)
    for fsdp_param in group.fsdp_params:
        require_attrs(fsdp_param, _PARAM_ATTRS, FLAVOUR)
        if getattr(fsdp_param, "is_dtensor", False) or hasattr(
            getattr(fsdp_param, "_sharded_local_tensor", None), "fsdp_pre_all_gather"
        ):
            raise ValueError(
                f"no_reshard_between_backwards(reshard_to={asked}): FSDP2 cannot reshard "
                "tensor-parallel (DTensor) parameters or tensor subclasses with "
                "fsdp_pre_all_gather (e.g. float8) to a smaller mesh. Drop reshard_to."
            )
    meshes = group.__dict__.setdefault(_MESHES_ATTR, {})
    key = (id(group.mesh_info.mesh), ranks)
    if ranks not in meshes:
        meshes[ranks] = known.get(key) or post_forward_mesh_info(ranks, group.mesh_info)
    info = known.setdefault(key, meshes[ranks])
    return _Mesh(info, [_param_meta(fp, info, ranks) for fp in group.fsdp_params])


def _param_meta(fsdp_param: Any, info: Any, ranks: int) -> tuple[Any, ...]:
    """A parameter's post-forward metadata for ``info``, computed as ``fully_shard`` does
    (from a meta tensor of the unsharded shape) once per parameter and ``ranks``."""
    cached = fsdp_param.__dict__.setdefault(_PARAM_META_ATTR, {})
    if ranks not in cached or cached[ranks][0] is not info:
        saved = tuple(getattr(fsdp_param, name, _MISSING) for name in _PARAM_MESH_ATTRS)
        fsdp_param.post_forward_mesh_info = info
        try:
            full = torch.empty(fsdp_param._orig_size, device="meta")
            fsdp_param._init_sharded_post_forward_param_metadata(full)
            cached[ranks] = tuple(getattr(fsdp_param, n) for n in _PARAM_MESH_ATTRS)
        finally:
            for name, value in zip(_PARAM_MESH_ATTRS, saved):
                if value is _MISSING:
                    fsdp_param.__dict__.pop(name, None)
                else:
                    setattr(fsdp_param, name, value)
    return cached[ranks]
