"""What the FSDP1 and FSDP2 backends share: options, pass bookkeeping, errors.

Nothing here touches private torch internals; that lives in ``_fsdp1.py`` and
``_fsdp2.py`` only.

[Note: why a retained graph needs unsharded storage]
FSDP keeps each parameter sharded and all-gathers the full (unsharded) tensor
just before a unit's forward. The autograd graph built by that forward saves
the *unsharded* tensors (e.g. the weight of a matmul, needed for the input
gradient). FSDP frees their storage after the unit's backward, because it
assumes each graph is walked exactly once:

- FSDP1 reshards in the post-backward hook (``_should_free_in_backward``):
  the flat parameter's storage is resized to 0 while the saved views still
  point at it. Its root final callback also clears
  ``_needs_pre_backward_unshard`` and drops the post-backward hooks, so a
  second backward neither re-gathers (``setStorage ... storage of size 0``)
  nor reduce-scatters (silently missing gradients).
- FSDP2 also resizes the all-gather output to 0 after backward, but its
  pre-backward hook re-gathers on every pass, so a retained graph works at the
  price of one all-gather per unit per extra backward, plus a reduce-scatter
  per unit per backward.

``no_reshard_between_backwards`` keeps that storage alive between passes
(``keep_unsharded=True``) or makes sure it is re-gathered before each pass
(``keep_unsharded=False``), and decides when gradients are reduced
(``sync_grads``). When the block ends the storage is freed again; the graph
may still hold the tensor objects, but they then own no memory.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn as nn

from ._saved_tensors import SavedTensorCheck

_SYNC_GRADS = ("every", "last")

# Attribute set on the root module while a block is active on it.
ACTIVE_ATTR = "_fsdp_retain_active_block"


@dataclasses.dataclass(frozen=True)
class RetainOptions:
    """The keyword options of ``no_reshard_between_backwards``, validated."""

    keep_unsharded: bool = True
    sync_grads: str = "every"
    backwards: int | None = None
    check_saved_tensors: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.keep_unsharded, bool):
            raise TypeError(
                f"keep_unsharded must be a bool, got {self.keep_unsharded!r}: "
                "pass True to keep parameters unsharded between backward passes "
                "or False to re-gather them per layer"
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


class PassTracker:
    """Counts backward passes inside one block and checks them against ``backwards``."""

    def __init__(self, backwards: int | None) -> None:
        self.backwards = backwards
        self.started = 0
        self.finished = 0
        self._warned_extra = False

    def begin(self) -> int:
        """Registers the start of a backward pass; returns its 1-based index."""
        self.started += 1
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



class BlockBase:
    """Lifecycle shared by the backends: install now or at the first forward, then
    finish (clean exit) or abort (exception exit), and always uninstall.

    A backend sets ``self.model``, ``self.options``, ``self.tracker`` and
    implements ``_root_decided``, ``_install_at_first_forward``, ``_install``,
    ``_finish``, ``_abort`` and ``_uninstall`` (which calls ``_release_model``).
    """

    model: nn.Module
    options: RetainOptions
    tracker: PassTracker
    _installed: bool = False
    _deferred_hook = None
    _saved_check: SavedTensorCheck | None = None

    @property
    def backward_passes(self) -> int:
        return self.tracker.started

    def enter(self) -> None:
        if self.options.check_saved_tensors:
            self._saved_check = SavedTensorCheck()
            self._saved_check.push()
        setattr(self.model, ACTIVE_ATTR, True)
        try:
            if self._root_decided():
                self._install()
            else:
                # FSDP picks its root at the first forward; install then.
                self._deferred_hook = self.model.register_forward_pre_hook(
                    self._install_at_first_forward, prepend=True
                )
        except BaseException:
            try:
                self._uninstall()
            finally:
                self._pop_saved_check()
            raise

    def exit(self, exc: BaseException | None) -> None:
        try:
            if not self._installed:
                return
            if exc is None:
                self._finish()
            else:
                self._abort()
        finally:
            try:
                self._uninstall()
            finally:
                self._pop_saved_check()

    def _pop_saved_check(self) -> None:
        # The graph keeps the hooks it already has; see
        # [Note: why a retained graph can silently read changed saved tensors].
        if self._saved_check is not None:
            self._saved_check.pop()

    def _take_deferred_hook(self) -> None:
        self._deferred_hook.remove()
        self._deferred_hook = None

    def _release_model(self) -> None:
        if self._deferred_hook is not None:
            self._deferred_hook.remove()
            self._deferred_hook = None
        self._installed = False
        if getattr(self.model, ACTIVE_ATTR, False):
            delattr(self.model, ACTIVE_ATTR)

def create_graph_needs_keep() -> RuntimeError:
    """Backward hooks run with grad mode on only under ``create_graph=True``."""
    return RuntimeError(
        "no_reshard_between_backwards: a backward with create_graph=True (higher-order "
        "gradients, gradient penalties) needs keep_unsharded=True. The gradient graph "
        "it builds uses the unsharded parameters outside FSDP's hooks, so they cannot "
        "be re-gathered per layer in a later backward."
    )


def missing_internal(what: str, flavour: str) -> RuntimeError:
    """Error for a private torch internal that this torch version lacks."""
    return RuntimeError(
        f"fsdp_retain: {flavour} internal {what!r} is missing in torch "
        f"{torch.__version__}. This fsdp_retain release supports the torch versions "
        "listed in its README; pin one of those or report the version."
    )


def require_attr(obj: object, name: str, flavour: str) -> object:
    """``getattr`` that fails loudly, naming the torch version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise missing_internal(f"{type(obj).__name__}.{name}", flavour) from None


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=3)


def first_wrapped_submodule(model: nn.Module, is_wrapped) -> str | None:
    """Name of the first submodule (not ``model``) for which ``is_wrapped`` is true."""
    for name, module in model.named_modules():
        if module is not model and is_wrapped(module):
            return name
    return None
