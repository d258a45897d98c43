"""``check_saved_tensors=True``: catch a retained graph whose saved tensors changed.

[Note: why a retained graph can silently read changed saved tensors]
A second backward over a retained graph reads the tensors the forward saved
for backward again. Torch guards them with version counters, but a kernel
that writes through a raw pointer bumps no counter: flash-attn's
``cross_entropy_loss(..., inplace_backward=True)`` writes its gradient into
the saved logits, so the next pass reads the gradient as logits and computes
silently wrong gradients. A storage freed or overwritten between passes (as
FSDP does with unsharded parameters) is the other way to get there.

The check pushes ``torch.autograd.graph.saved_tensors_hooks`` for the block.
Packing records each saved tensor's version and a fingerprint (a strided
sample of ``_SAMPLE`` elements and the sum, compared bit for bit; no copy of
the tensor). Every unpack checks the version and that the storage is not
freed; every unpack after the first (a later pass reusing the tensor) also
recomputes the fingerprint and raises before the node uses the tensor. On an
accelerator that comparison waits for the device (one host sync per reused
saved tensor).

- Saved-tensor hooks turn off torch's own version-counter check of the
  tensors they pack, so this module checks the version itself, with torch's
  wording.
- Hooks are thread-local and the innermost wins: inside a non-reentrant
  activation-checkpointed region torch's checkpoint hooks pack the tensors,
  and this check sees none of them (they are recomputed for each backward).
- The hooks stay on the graph after the block exits: a later backward over
  it is still checked.
- Tensor subclasses other than ``DTensor`` (checked through their local
  shard), nested and sparse tensors, and unusual dtypes get the version
  check only.
"""

from __future__ import annotations

import math
import sys
from types import FrameType

import torch
import torch.distributed as dist

from ._common import RetainError, loud

_SAMPLE = 16  # elements compared bit for bit, spread over the tensor

# The sum's accumulation dtype per saved dtype (a float64 sum of float32 is
# ~60x slower on CPU), and the integer dtype of the same size the fingerprint
# is compared in, bit for bit (NaN equals itself).
_ACCUMULATE = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    **{t: torch.int64 for t in (torch.bool, torch.uint8, torch.int8, torch.int16,
                                torch.int32, torch.int64)},
}
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.int64: torch.int64}


def _dtensor_type():
    if not dist.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def _plain(tensor: torch.Tensor) -> torch.Tensor | None:
    """The plain strided tensor whose values we can read locally, or ``None``."""
    if _DTENSOR is not None and isinstance(tensor, _DTENSOR):
        tensor = tensor.to_local()
    if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return None  # a wrapper subclass: its storage is not its values
    if tensor.is_nested or tensor.layout != torch.strided or tensor.is_meta:
        return None
    return tensor


def _freed(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def fingerprint(tensor: torch.Tensor) -> torch.Tensor | None:
    """A tensor of ``_SAMPLE + 1`` integers, on ``tensor``'s device, that changes when
    its values do: a strided sample and the sum, as bits.

    ``None`` when the values cannot be read (see the module docstring), are
    empty, or live in a freed storage.
    """
    plain = _plain(tensor)
    if plain is None or plain.numel() == 0 or _freed(plain):
        return None
    accumulate = _ACCUMULATE.get(plain.dtype)
    if accumulate is None:
        return None
    with torch.no_grad():
        view = plain.detach()
        if view.is_contiguous():
            step = max(1, view.numel() // _SAMPLE)
            sample = view.view(-1)[: step * _SAMPLE : step]
        else:
            per_dim = math.ceil(_SAMPLE ** (1 / view.dim()))
            steps = [max(1, n // per_dim) for n in view.shape]
            sample = view[tuple(slice(0, per_dim * step, step) for step in steps)].reshape(-1)
        total = view.sum(dtype=accumulate)
        return torch.cat([sample.to(accumulate), total.view(1)]).view(_BITS[accumulate])


def _describe_tensor(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)}, {tensor.dtype}, {tensor.device}"


class _Saved:
    """What the pack hook keeps: the tensor and what it looked like when saved."""

    __slots__ = ("tensor", "version", "fingerprint", "saved_by", "reads")  # saved_by: see _saved_by

    def __init__(self, tensor, version, fingerprint, saved_by) -> None:
        self.tensor = tensor
        self.version = version
        self.fingerprint = fingerprint
        self.saved_by = saved_by
        self.reads = 0


# The frame of ``loud``'s wrapper around ``_unpack`` is not a caller either.
_LOUD_CODE = loud(lambda: None).__code__


def _caller(depth: int):
    """The first frame, ``depth`` or more frames up, whose code is not this module's
    (nor ``loud``'s wrapper)."""
    frame: FrameType | None
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:  # called from an autograd thread with no Python caller
        return None
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code is _LOUD_CODE
    ):
        frame = frame.f_back
    return frame


def _saved_by() -> tuple | None:
    """Where the tensor was saved: the Python line that ran the op (cheap; formatted
    only for an error message)."""
    frame = _caller(2)
    return None if frame is None else (frame.f_code, frame.f_lineno)


def _reading_node() -> str | None:
    """The custom ``autograd.Function`` node reading its saved tensors, if that is who
    unpacks: its Python ``backward(ctx, ...)`` reads ``ctx.saved_tensors``, and ``ctx``
    is the node (``<class name>Backward``). Built-in nodes unpack from C++."""
    frame = _caller(1)
    ctx = None if frame is None else frame.f_locals.get("ctx")
    if ctx is not None and hasattr(ctx, "next_functions") and callable(getattr(ctx, "name", None)):
        return ctx.name()
    return None


def _node_name(saved: _Saved) -> str:
    reader = _reading_node()
    if reader is not None:
        return f"autograd node {reader}"
    if saved.saved_by is None:
        return "an autograd node"
    code, line = saved.saved_by
    return (
        f"the autograd node of the op called at {code.co_filename}:{line} "
        f"(in {code.co_name})"
    )


_LIKELY_CAUSE = (
    "The likely cause is a backward kernel that writes into its saved input in "
    "place (flash-attn's cross_entropy_loss(..., inplace_backward=True), as used "
    "by verl's logprobs_from_logits: pass inplace_backward=False) or a storage "
    "that was freed or overwritten between backward passes."
)


class SavedTensorCheck:
    """Pushes the fingerprinting ``saved_tensors_hooks`` (``push``) and pops them (``pop``)."""

    def __init__(self) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._pushed = False

    def push(self) -> None:
        self._hooks.__enter__()
        self._pushed = True

    def pop(self) -> None:
        """Idempotent; the graph keeps the hooks it already has."""
        if self._pushed:
            self._pushed = False
            self._hooks.__exit__(None, None, None)

    @staticmethod
    def _pack(tensor: torch.Tensor) -> _Saved:
        # Outputs arrive with their grad_fn, which saves this very tensor:
        # keep a detached alias (same storage and version counter) so the
        # node and the tensor do not keep each other alive.
        kept = tensor if tensor.grad_fn is None else tensor.detach()
        return _Saved(kept, tensor._version, fingerprint(tensor), _saved_by())

    @staticmethod
    @loud
    def _unpack(saved: _Saved) -> torch.Tensor:
        saved.reads += 1
        tensor = saved.tensor
        if tensor._version != saved.version:
            raise RetainError(
                "one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: [{_describe_tensor(tensor)}] saved "
                f"by {_node_name(saved)} is at version {tensor._version}; "
                f"expected version {saved.version} instead. (no_reshard_between_backwards"
                "(check_saved_tensors=True) packs saved tensors itself, so it performs "
                "torch's version check for them.)"
            )
        plain = _plain(tensor)
        if plain is None or saved.fingerprint is None:
            return tensor
        if _freed(plain):
            raise RetainError(
                "no_reshard_between_backwards(check_saved_tensors=True): a tensor saved "
                f"for backward by {_node_name(saved)} ({_describe_tensor(tensor)}) "
                f"lives in a freed storage (size 0) when it is read for backward the "
                f"{_ordinal(saved.reads)} time; the node would fail or read garbage. "
                + _LIKELY_CAUSE
            )
        if saved.reads == 1:
            return tensor  # the first pass reads what the forward saved
        fresh = fingerprint(plain)
        assert fresh is not None  # None only for what was never fingerprinted
        if not torch.equal(fresh, saved.fingerprint):
            raise RetainError(
                "no_reshard_between_backwards(check_saved_tensors=True): a tensor saved "
                f"for backward by {_node_name(saved)} ({_describe_tensor(tensor)}) "
                f"changed after the forward saved it, without a version-counter bump; it "
                f"was caught when read for backward the {_ordinal(saved.reads)} time, "
                "before the node used it (its gradients would have been silently wrong). "
                + _LIKELY_CAUSE
            )
        return tensor


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
