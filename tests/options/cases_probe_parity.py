"""Probe passes (``block.backward(loss, param_grads=False)``): parity, the plain way and
misuse (part of ``tests/options/cases_probe.py``; CPU, gloo, world size 2).

Each parity case trains an FSDP model and an unsharded reference for 3
SGD-momentum steps of 1 or 2 micro-batches (the first under FSDP1
``no_sync()`` / FSDP2 ``set_requires_gradient_sync(False)``), each micro-batch
one forward and 2 or 3 passes mixing probe (``p``) and normal (``n``) passes
(``_grid``: each case meets every keep_unsharded x sync_grads pair and every
pass pattern, with backwards known or not). It checks:

- the activation-hook gradients of every probe pass (tensor hooks on each
  block's ``fc1`` output, full backward hooks on each block's ``fc2`` and the
  root's ``out``) against the reference's for the same loss;
- every gradient FSDP holds on a rank (``.grad``, sharded or not, and the
  unreduced gradients FSDP keeps aside) is unchanged by every probe pass;
- the final gradients and the parameters after each step against the
  reference (accumulated over micro-batches, averaged over ranks);
- the collectives of every micro-batch against a formula
  (``expected_counts``): probe passes re-gather like normal passes and
  reduce nothing.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_handles
from fsdp_retain._fsdp2._inspect import fsdp2_param_groups
from fsdp_retain._measure import count_collectives
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    OPTION_GRID,
    Adapter,
    assert_close_dicts,
    averaged_grads,
    batch,
    block_options,
    make_net,
    reference_copy,
    sgd,
)

registry = Registry()

STEPS = 3
PATTERNS = ("pn", "np", "pnp", "npn")  # p: probe pass, n: normal pass


class HookRecorder:
    """Gradients seen by activation hooks during one backward pass."""

    def __init__(self, model: nn.Module) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            name = _clean(name)
            if name.endswith("fc1"):
                module.register_forward_hook(self._tensor_hook(name))
            elif name.endswith("fc2") or name == "out":
                module.register_full_backward_hook(self._module_hook(name))

    def _tensor_hook(self, name: str):
        def forward_hook(module, args, output) -> None:
            if output.requires_grad:
                output.register_hook(lambda g: self._put(f"{name}:out", g))

        return forward_hook

    def _module_hook(self, name: str):
        def backward_hook(module, grad_input, grad_output) -> None:
            self._put(f"{name}:grad_output", grad_output[0])
            self._put(f"{name}:grad_input", grad_input[0])

        return backward_hook

    def _put(self, key: str, grad: torch.Tensor | None) -> None:
        assert key not in self.grads, f"hook {key} fired twice in one pass"
        if grad is not None:
            self.grads[key] = grad.detach().clone()

    def take(self) -> dict[str, torch.Tensor]:
        grads, self.grads = self.grads, {}
        return grads


def _clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name.removeprefix("_fsdp_wrapped_module")


def _put_grad(grads: dict, key: str, grad) -> None:
    if grad is not None:
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        grads[key] = grad.detach().clone()


def fsdp1_held_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient FSDP1 holds on this rank: each flat parameter's ``.grad``
    (sharded, or unsharded and unreduced) and ``_saved_grad_shard``."""
    grads: dict[str, torch.Tensor] = {}
    for i, handle in enumerate(fsdp1_handles(model)):
        flat_param = handle.flat_param
        _put_grad(grads, f"{i}.grad", flat_param.grad)
        _put_grad(grads, f"{i}.saved", getattr(flat_param, "_saved_grad_shard", None))
    return grads


def fsdp2_held_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient FSDP2 holds on this rank: the sharded ``.grad`` and the
    unreduced unsharded gradients of each parameter."""
    grads: dict[str, torch.Tensor] = {}
    for i, group in enumerate(fsdp2_param_groups(model)):
        for j, fsdp_param in enumerate(group.fsdp_params):
            key = f"{i}.{j}"
            _put_grad(grads, f"{key}.grad", fsdp_param.sharded_param.grad)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            _put_grad(grads, f"{key}.unsharded", getattr(unsharded, "grad", None))
            _put_grad(grads, f"{key}.accumulated", fsdp_param.unsharded_accumulated_grad)
    return grads


class Flavour:
    """How to wrap, read and accumulate for one backend configuration."""

    def __init__(
        self,
        name: str,
        wrap: Callable[[nn.Module], nn.Module],
        adapter: Adapter,
        no_sync: Callable[[nn.Module, bool], contextlib.AbstractContextManager],
        counts: Callable[..., dict[str, int]],
        held_grads: Callable[[nn.Module], dict[str, torch.Tensor]],
    ) -> None:
        self.name, self.wrap, self.adapter = name, wrap, adapter
        self.no_sync, self.counts, self.held_grads = no_sync, counts, held_grads


def _fsdp1_no_sync(model: nn.Module, sync: bool):
    return contextlib.nullcontext() if sync else model.no_sync()


@contextlib.contextmanager
def _fsdp2_no_sync(model: nn.Module, sync: bool):
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reductions(units: int, normal: int, sync_grads: str, synced: bool) -> int:
    """Gradient reductions per micro-batch: none in a no-sync micro-batch, and
    only for normal passes: one per unit per normal pass ("every"), or one per
    unit if any pass was normal ("last"). Probe passes reduce nothing."""
    if not synced or normal == 0:
        return 0
    return units * (normal if sync_grads == "every" else 1)


def _fsdp1_flavour(strategy, uop) -> Flavour:
    def counts(model, passes, normal, keep, sync_grads, synced):
        reduced = reductions(f1.units(model), normal, sync_grads, synced)
        sharded = strategy != f1.NO_SHARD
        return dict(
            all_gather=f1.expected_all_gathers(model, passes, keep, strategy),
            reduce_scatter=reduced if sharded else 0,
            all_reduce=0 if sharded else reduced,
        )

    name = f"fsdp1_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}"
    return Flavour(
        name,
        lambda m: f1.wrap(m, strategy, use_orig_params=uop),
        f1.ADAPTER,
        _fsdp1_no_sync,
        counts,
        fsdp1_held_grads,
    )


def _fsdp2_flavour(raf: bool) -> Flavour:
    def counts(model, passes, normal, keep, sync_grads, synced):
        return dict(
            all_gather=f2.expected_all_gathers(model, passes, keep, raf),
            reduce_scatter=reductions(f2.units(model), normal, sync_grads, synced),
            all_reduce=0,
        )

    return Flavour(
        f"fsdp2_{'raf' if raf else 'noraf'}",
        lambda m: f2.wrap(m, reshard_after_forward=raf),
        f2.ADAPTER,
        _fsdp2_no_sync,
        counts,
        fsdp2_held_grads,
    )


FLAVOURS = [
    _fsdp1_flavour(strategy, uop)
    for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP, f1.NO_SHARD), (False, True))
] + [_fsdp2_flavour(True), _fsdp2_flavour(False)]


def _inputs(step: int, micro: int) -> torch.Tensor:
    return batch(10 * step + micro)


def reference_micro_batch(ref, recorder, x, pattern) -> list[dict[str, torch.Tensor]]:
    """Normal passes accumulate into ``.grad``; probe passes only fire hooks."""
    out = ref(x)
    probes = []
    for i, kind in enumerate(pattern):
        loss = LOSSES[i % len(LOSSES)](out)
        if kind == "p":
            params = [p for p in ref.parameters() if p.requires_grad]
            torch.autograd.grad(loss, params, retain_graph=True)
            probes.append(recorder.take())
        else:
            loss.backward(retain_graph=True)
            recorder.take()
    return probes


def fsdp_micro_batch(model, recorder, x, pattern, options, flavour, synced, where):
    """One micro-batch through the block; checks probes leave ``.grad`` alone."""
    probes = []
    with count_collectives() as counts:
        with flavour.no_sync(model, synced), no_reshard_between_backwards(
            model, **options
        ) as block:
            out = model(x)
            for i, kind in enumerate(pattern):
                loss = LOSSES[i % len(LOSSES)](out)
                retain = i < len(pattern) - 1
                with counts.excluded():
                    before = flavour.held_grads(model)
                block.backward(loss, param_grads=kind == "n", retain_graph=retain)
                if kind == "p":
                    probes.append(recorder.take())
                    with counts.excluded():
                        assert_close_dicts(
                            flavour.held_grads(model), before, f"{where}: held grads after probe {i + 1}"
                        )
                else:
                    recorder.take()
            assert block.backward_passes == len(pattern)
    return probes, counts


def run_probe_parity(flavour: Flavour, micro_batches: int, configs) -> None:
    """For each (keep, sync, pattern, backwards): 3 steps against the reference."""
    for keep, sync, pattern, backwards in configs:
        options = block_options(keep, sync, len(pattern) if backwards else None)
        model = make_net()
        ref = reference_copy(model)
        ref_recorder, recorder = HookRecorder(ref), HookRecorder(model)
        model = flavour.wrap(model)
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(STEPS):
            where = (
                f"{flavour.name} micro_batches={micro_batches} pattern={pattern} "
                f"options={options} step {step}"
            )
            for micro in range(micro_batches):
                x = _inputs(step, micro)
                synced = micro == micro_batches - 1
                ref_probes = reference_micro_batch(ref, ref_recorder, x, pattern)
                probes, counts = fsdp_micro_batch(
                    model, recorder, x, pattern, options, flavour, synced, f"{where} mb {micro}"
                )
                for i, (got, want) in enumerate(zip(probes, ref_probes)):
                    assert want, "the reference probe fired no hooks"
                    assert_close_dicts(got, want, f"{where} mb {micro}: probe {i} hooks")
                expected = flavour.counts(
                    model, len(pattern), pattern.count("n"), keep, sync, synced
                )
                assert counts.as_dict() == expected, (
                    f"{where} mb {micro}: collectives {counts.by_op}, expected {expected}"
                )
            ref_grads = averaged_grads(ref)
            for name, param in ref.named_parameters():
                param.grad = ref_grads[name]
            assert_close_dicts(flavour.adapter.full_grads(model), ref_grads, f"{where}: grads")
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts(flavour.adapter.full_params(model), ref_params, f"{where}: params")


def _grid(index: int) -> list[tuple[bool, str, str, bool]]:
    """Four configurations for case ``index``: every pass pattern once, each with
    another (keep_unsharded, sync_grads) pair, so that every case (one flavour,
    one micro-batch count) meets all four pairs and all four patterns, and
    backwards alternates between known and None."""
    return [
        (*OPTION_GRID[(index + j) % len(OPTION_GRID)], pattern, (index // 2 + j) % 2 == 1)
        for j, pattern in enumerate(PATTERNS)
    ]


for _index, (_flavour, _micro) in enumerate(itertools.product(FLAVOURS, (1, 2))):
    registry.add(
        f"parity_{_flavour.name}_mb{_micro}",
        lambda f=_flavour, m=_micro, i=_index: run_probe_parity(f, m, _grid(i)),
    )


# The plain way, and misuse #
def _one_accumulated_step(flavour: Flavour, probe: str) -> float:
    """One optimizer step of 2 micro-batches: pass 1 on ``LOSSES[0]`` only for
    its hooks, pass 2 on ``LOSSES[1]`` accumulated. ``probe`` is how pass 1 runs:
    ``"block"`` (``block.backward(param_grads=False)``, first micro-batch under
    no-sync), ``"plain_no_sync"`` (FSDP2 without the library: ``.backward()`` +
    ``zero_grad()``, first micro-batch under no-sync) or ``"plain_sync"`` (the
    block with ``.backward()`` + ``zero_grad()``, no no-sync). Returns the largest
    parameter difference from the reference, which trains on pass 2 only."""
    model = make_net()
    ref = reference_copy(model)
    model = flavour.wrap(model)
    opt, ref_opt = sgd(model), sgd(ref)
    for micro in range(2):
        x = _inputs(0, micro)
        LOSSES[1](ref(x)).backward()
        synced = micro == 1 or probe == "plain_sync"
        block = (
            contextlib.nullcontext()
            if probe == "plain_no_sync"
            else no_reshard_between_backwards(model)
        )
        with flavour.no_sync(model, synced), block as b:
            out = model(x)
            if probe == "block":
                b.backward(LOSSES[0](out), param_grads=False, retain_graph=True)
            else:
                LOSSES[0](out).backward(retain_graph=True)
                opt.zero_grad()
            LOSSES[1](out).backward()
    ref_grads = averaged_grads(ref)
    for name, param in ref.named_parameters():
        param.grad = ref_grads[name]
    opt.step()
    ref_opt.step()
    got = flavour.adapter.full_params(model)
    return max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@registry.case()
def plain_backward_and_zero_grad_is_wrong_under_accumulation() -> None:
    """FSDP2 without the library, first micro-batch under
    set_requires_gradient_sync(False): zero_grad() does not drop pass 1's
    gradients (held outside .grad). FSDP1 in the block, accumulating without
    no_sync(): zero_grad() erases the first micro-batch. The probe pass is
    right in both."""
    fsdp2, fsdp1 = _fsdp2_flavour(True), _fsdp1_flavour(f1.FULL, False)
    assert _one_accumulated_step(fsdp2, "plain_no_sync") > 1e-3
    assert _one_accumulated_step(fsdp1, "plain_sync") > 1e-3
    assert _one_accumulated_step(fsdp2, "block") < 1e-5
    assert _one_accumulated_step(fsdp1, "block") < 1e-5


@registry.case()
def probe_misuse_gets_clear_errors() -> None:
    """A forward without grad, a non-bool param_grads, a call after the block
    exited; the next step still works. (Only the root wrapped is fine: the probe
    targets are the activation frontier, not unit inputs alone.)"""
    model = f2.wrap(make_net(), wrapped_blocks=[])
    x = batch(0)
    with no_reshard_between_backwards(model) as block:
        with torch.no_grad():
            model(x)
        frozen = x.clone().requires_grad_()
        try:
            block.backward(frozen.sum(), param_grads=False, retain_graph=True)
        except ValueError as exc:
            assert "nothing to differentiate" in str(exc), exc
        else:
            raise AssertionError("expected a ValueError")
        out = model(x)
        block.backward(out.sum(), param_grads=False, retain_graph=True)
        try:
            block.backward(out.sum(), param_grads="no", retain_graph=True)
        except TypeError as exc:
            assert "param_grads must be a bool" in str(exc), exc
        else:
            raise AssertionError("expected a TypeError")
        block.backward(out.sum())
    try:
        block.backward(out.sum(), param_grads=False)
    except RuntimeError as exc:
        assert "after its no_reshard_between_backwards block exited" in str(exc), exc
    else:
        raise AssertionError("expected a RuntimeError")
    model.zero_grad()
    with no_reshard_between_backwards(model):
        model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _unsharded_blocks(model: nn.Module) -> list[int]:
    """Indices of the blocks whose unsharded parameters own memory now."""
    found = []
    for i, block in enumerate(model.blocks if hasattr(model, "blocks") else model.module.blocks):
        if hasattr(block, "_handle"):  # FSDP1 unit
            flat_param = block._handle.flat_param
            if flat_param._full_param_padded.untyped_storage().size():
                found.append(i)
        elif not fsdp2_param_groups(block)[0].is_sharded:
            found.append(i)
    return found


@registry.case()
def regathering_probe_frees_each_unit_after_its_backward() -> None:
    """keep_unsharded=False, FSDP1 FULL_SHARD and FSDP2: when the probe pass
    reaches the first block, the later blocks are resharded again (memory
    stays that of one or two units, as in a normal pass)."""
    for flavour in (_fsdp1_flavour(f1.FULL, False), _fsdp2_flavour(True)):
        model = flavour.wrap(make_net())
        seen: list[list[int]] = []
        inner = model.module if hasattr(model, "module") else model
        first_fc1 = inner.blocks[0].fc1

        def forward_hook(module, args, out) -> None:
            out.register_hook(lambda grad: seen.append(_unsharded_blocks(model)))

        first_fc1.register_forward_hook(forward_hook)
        with no_reshard_between_backwards(model, keep_unsharded=False) as block:
            out = model(batch(0))
            block.backward(LOSSES[0](out), param_grads=False, retain_graph=True)
            probe_seen = seen.pop()
            LOSSES[1](out).backward()
        assert probe_seen == [0], f"{flavour.name}: unsharded during the probe: {probe_seen}"
        assert seen == [[0]], f"{flavour.name}: unsharded during the normal pass: {seen}"
