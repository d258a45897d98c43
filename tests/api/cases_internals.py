"""A torch without a private FSDP internal the block uses: the block refuses at its
entry, naming the internal and the torch version, and leaves FSDP as it found it
(instead of an ``AttributeError`` in the middle of a backward).

Run inside ranks by ``tests/api/test_internals.py`` (CPU, gloo, world size 2).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp2 import _compat as _fsdp2_compat
from fsdp_retain._fsdp1._inspect import fsdp1_snapshot
from fsdp_retain._fsdp2._inspect import fsdp2_snapshot
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import batch, make_net

registry = Registry()


@contextlib.contextmanager
def _without(cls: type, name: str):
    """``cls`` (and its instances) without the class attribute ``name``."""
    owner = next(c for c in cls.__mro__ if name in c.__dict__)
    value = owner.__dict__[name]
    delattr(owner, name)
    try:
        yield
    finally:
        setattr(owner, name, value)


@contextlib.contextmanager
def _without_on(obj: object, name: str):
    """``obj`` without the instance attribute ``name``."""
    value = obj.__dict__.pop(name)
    try:
        yield
    finally:
        obj.__dict__[name] = value


def _two_passes(model) -> None:
    with no_reshard_between_backwards(model, backwards=2):
        out = model(batch(0))
        out.pow(2).mean().backward(retain_graph=True)
        out.mean().backward()
    model.zero_grad(set_to_none=True)


def _refused_at_entry(model, snapshot, missing, what: str) -> None:
    _two_passes(model)  # FSDP's lazy init: the block then installs at its entry
    before = snapshot(model)
    version = torch.__version__.replace("+", r"\+")
    # FSDP2 probes each type once per process: as if this torch lacked it from the start.
    _fsdp2_compat.forget_probes()
    with missing():
        with pytest.raises(RuntimeError, match=rf"{what}' is missing in torch {version}"):
            with no_reshard_between_backwards(model):
                raise AssertionError("the block was entered")
    assert snapshot(model) == before, "a refused block left FSDP changed"
    _two_passes(model)  # and the next block works
    assert snapshot(model) == before


def _fsdp1_handle_class():
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    return FlatParamHandle


def _fsdp2_param_class():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        from torch.distributed._composable.fsdp._fsdp_param import FSDPParam  # type: ignore
    return FSDPParam


@registry.case()
def fsdp1_missing_handle_method() -> None:
    model = f1.wrap(make_net())
    missing = functools.partial(_without, _fsdp1_handle_class(), "prepare_gradient_for_backward")
    _refused_at_entry(model, fsdp1_snapshot, missing,
                      "FSDP1 internal 'FlatParamHandle.prepare_gradient_for_backward")


@registry.case()
def fsdp1_missing_state_attribute() -> None:
    model = f1.wrap(make_net(), use_orig_params=True)
    unit = next(m for m in model.modules() if m is not model and hasattr(m, "_handle"))
    missing = functools.partial(_without_on, unit, "_pre_unshard_stream")
    _refused_at_entry(model, fsdp1_snapshot, missing,
                      "FSDP1 internal 'FullyShardedDataParallel._pre_unshard_stream")


@registry.case()
def fsdp2_missing_param_method() -> None:
    model = f2.wrap(make_net())
    missing = functools.partial(_without, _fsdp2_param_class(), "_setattr_on_modules")
    _refused_at_entry(model, fsdp2_snapshot, missing, "FSDP2 internal 'FSDPParam._setattr_on_modules")


@registry.case()
def fsdp2_missing_root_method() -> None:
    model = f2.wrap(make_net())
    state = model._get_fsdp_state()
    missing = functools.partial(_without, type(state), "_root_post_backward_final_callback")
    _refused_at_entry(model, fsdp2_snapshot, missing,
                      "FSDP2 internal 'FSDPState._root_post_backward_final_callback")
