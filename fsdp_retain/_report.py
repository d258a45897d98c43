"""Memory, time and communication of the library against a second forward.

The code behind ``scripts/memory_report.py`` (see ``docs/report/README.md``).
One causal LM built from a ``transformers`` ``Qwen2Config`` (random weights),
wrapped per decoder layer plus root, runs one training step with two losses
from one forward (a token log-prob loss, then a policy-gradient loss with
random advantages) in each mode:

- ``two_forward``: forward, backward, forward again, backward (what users do
  without the library);
- ``naive``: ``retain_graph=True`` without the library;
- ``keep:<sync_grads>``: the library with ``keep_unsharded=True``;
- ``regather:<sync_grads>``: the library with ``keep_unsharded=False``.

Per mode and rank it measures, in this order and in separate steps: the
median step time of interleaved, uninstrumented steps (so that load drift
hits every mode alike); the collectives of one step; the peak memory of one
step (``torch.cuda.max_memory_allocated`` on GPU) and its breakdown at the
peak from torch's ``FSDPMemTracker`` (FSDP2) or ``MemTracker`` (FSDP1).
``--simulate-world-size N`` estimates memory only, for N ranks, in one
process with a fake process group and fake tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MODES",
    "SIZES",
    "Mode",
    "ReportConfig",
    "main",
    "parse_args",
    "run_report",
]

BACKENDS = ("fsdp2", "fsdp1")
DEFAULT_MODES = ("two_forward", "naive", "keep:every", "keep:last", "regather:every")
BACKWARDS = 2  # backward passes per step; passed to the library as ``backwards``
KEEP_SLACK = 0.10  # keep: overhead <= unsharded bytes of all units + 10%
REGATHER_SLACK = 0.05  # regather: peak <= two_forward peak + 5%
MIN_TIMED_STEPS = 10
_CONFIG_ENV = "FSDP_RETAIN_REPORT_CONFIG"
_TRACEBACKS_ENV = "FSDP_RETAIN_REPORT_TRACEBACKS"  # set to print each failure's traceback
_MIB = 2**20

# Qwen2.5 shapes (published configs); "tiny" and "small" are for CPU runs.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=3, hidden=64, intermediate=128, heads=4, kv_heads=2,
                 vocab=2048, tie=False, seq_len=64, batch=2),
    "small": dict(layers=4, hidden=256, intermediate=704, heads=8, kv_heads=2,
                  vocab=8192, tie=False, seq_len=128, batch=4),
    "0.5b": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2,
                 vocab=151936, tie=True, seq_len=2048, batch=1),
    "1.5b": dict(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2,
                 vocab=151936, tie=True, seq_len=2048, batch=1),
    "3b": dict(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2,
               vocab=151936, tie=True, seq_len=2048, batch=1),
    "7b": dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
               vocab=152064, tie=False, seq_len=2048, batch=1),
}
_DIM_FLAGS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq_len", "batch")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# Configuration #
@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of running the two backward passes; ``label`` is ``name[:sync_grads]``."""

    name: str
    sync_grads: str | None = None

    @classmethod
    def parse(cls, text: str) -> Mode:
        name, _, sync = text.partition(":")
        if name in ("two_forward", "naive") and not sync:
            return cls(name)
        if name in ("keep", "regather") and sync in ("every", "last", ""):
            return cls(name, sync or "every")
        raise ValueError(
            f"unknown mode {text!r}: use two_forward, naive, keep:every, keep:last, "
            "regather:every or regather:last"
        )

    @property
    def label(self) -> str:
        return self.name if self.sync_grads is None else f"{self.name}:{self.sync_grads}"

    @property
    def uses_library(self) -> bool:
        return self.name in ("keep", "regather")


@dataclasses.dataclass
class ReportConfig:
    """Everything a report run needs; ``parse_args`` builds one from the CLI."""

    backends: tuple[str, ...] = BACKENDS
    modes: tuple[str, ...] = DEFAULT_MODES
    device: str = "cpu"
    nproc: int | None = None  # ranks: cpu 2, cuda all visible GPUs
    dtype: str = "fp32"
    size: str = "small"
    layers: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    seq_len: int | None = None
    batch: int | None = None
    warmup: int = 2
    steps: int = MIN_TIMED_STEPS
    simulate_world_size: int | None = None
    out: str = "report_out"
    seed: int = 42
    timeout: float = 1800.0
    command: str = ""

    def __post_init__(self) -> None:
        self.backends = tuple(self.backends)
        self.modes = tuple(self.modes)
        for backend in self.backends:
            if backend not in BACKENDS:
                raise ValueError(f"unknown backend {backend!r}: use fsdp1 and/or fsdp2")
        labels = [Mode.parse(m).label for m in self.modes]
        if "two_forward" not in labels:
            raise ValueError("modes must include two_forward: savings and overheads are against it")
        self.modes = tuple(labels)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {sorted(SIZES)}, got {self.size!r}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("steps must be >= 1 and warmup >= 0")
        dims = self.dims()
        if dims["hidden"] % dims["heads"] or dims["heads"] % dims["kv_heads"]:
            raise ValueError(
                f"hidden ({dims['hidden']}) must divide by heads ({dims['heads']}) and "
                f"heads by kv_heads ({dims['kv_heads']})"
            )

    def dims(self) -> dict[str, Any]:
        dims = dict(SIZES[self.size])
        for name in _DIM_FLAGS:
            if getattr(self, name) is not None:
                dims[name] = getattr(self, name)
        return dims

    def mode_list(self) -> list[Mode]:
        return [Mode.parse(m) for m in self.modes]

    def world_size(self) -> int:
        if self.nproc is not None:
            return self.nproc
        if self.device == "cuda":
            import torch

            return max(torch.cuda.device_count(), 1)
        return 2


def parse_args(argv: list[str] | None = None) -> ReportConfig:
    parser = argparse.ArgumentParser(
        prog="memory_report.py",
        description=(
            "Peak memory, step time and collectives of fsdp_retain's modes against a "
            "second forward, on a Qwen2-shaped causal LM with random weights. Writes "
            "report.json, report.md and report.png into --out."
        ),
    )
    parser.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                        help="FSDP flavours to run, in order (default: fsdp2 fsdp1)")
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES),
                        help="two_forward naive keep:every keep:last regather:every regather:last")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: gloo; cuda: NCCL, one GPU per rank")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to launch (cpu: 2, cuda: all GPUs); ignored under torchrun")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES),
                        help="parameter (and gradient) dtype")
    parser.add_argument("--size", default="small", choices=list(SIZES),
                        help="model preset; the flags below override its fields")
    for name in _DIM_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, dest=name)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--steps", type=int, default=MIN_TIMED_STEPS,
                        help=f"timed steps per mode (median; use >= {MIN_TIMED_STEPS})")
    parser.add_argument("--simulate-world-size", type=int, default=None,
                        help="estimate per-rank memory for N ranks in this process (fake process "
                             "group and fake tensors; memory only)")
    parser.add_argument("--out", default="report_out", help="output directory")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before a launch or a collective gives up")
    args = parser.parse_args(argv)
    raw = sys.argv[1:] if argv is None else argv
    launcher = "python"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', '?')}"
    return ReportConfig(
        backends=tuple(args.backend),
        modes=tuple(args.modes),
        device=args.device,
        nproc=args.nproc,
        dtype=args.dtype,
        size=args.size,
        warmup=args.warmup,
        steps=args.steps,
        simulate_world_size=args.simulate_world_size,
        out=args.out,
        seed=args.seed,
        timeout=args.timeout,
        command=f"{launcher} scripts/memory_report.py {shlex.join(raw)}".strip(),
        **{name: getattr(args, name) for name in _DIM_FLAGS},
    )


# The model, its wrapping and the training step #
def _torch_dtype(cfg: ReportConfig):
    import torch

    return getattr(torch, _DTYPES[cfg.dtype])


def build_model(cfg: ReportConfig, device):
    """A ``Qwen2ForCausalLM`` with random weights (seed ``cfg.seed``), in ``cfg.dtype``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = cfg.dims()
    config = Qwen2Config(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=max(32768, dims["seq_len"]),
        tie_word_embeddings=dims["tie"],
        use_cache=False,
    )
    torch.manual_seed(cfg.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(_torch_dtype(cfg))
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def wrap(model, backend: str, device, mesh=None):
    """Shards each decoder layer, then the root, with ``backend``'s defaults."""
    layers = model.model.layers
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}), device_id=device
    )


def fsdp_units(model, backend: str) -> int:
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return len(FullyShardedDataParallel.fsdp_modules(model))
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def make_batch(cfg: ReportConfig, rank: int, device):
    import torch

    dims = cfg.dims()
    gen = torch.Generator().manual_seed(cfg.seed + rank + 1)
    ids = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq_len"]), generator=gen)
    advantages = torch.randn(dims["batch"], generator=gen)
    return ids.to(device), advantages.to(device)


def token_logprobs(model, ids):
    """Log-probability of each next token, from one forward."""
    import torch

    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    picked = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked.float() - torch.logsumexp(logits, dim=-1).float()


def logprob_loss(logp):
    return -logp.mean()


def policy_loss(logp, advantages):
    return -(advantages[:, None] * logp).mean()


class StepHooks:
    """What a measurement wraps around parts of a step (defaults do nothing).

    ``segment()`` encloses each forward with the backward passes over it;
    ``mark(name)`` stamps the time at a point of the step.
    """

    def segment(self):
        return contextlib.nullcontext()

    def mark(self, name: str) -> None:
        pass


_NO_HOOKS = StepHooks()


def train_step(model, optimizer, batch, mode: Mode, hooks: StepHooks = _NO_HOOKS) -> None:
    """One optimizer step with the log-prob loss and the policy loss, run as ``mode`` says."""
    from . import no_reshard_between_backwards

    ids, advantages = batch
    if mode.name == "two_forward":
        with hooks.segment():
            logp = token_logprobs(model, ids)
            logprob_loss(logp).backward()
            del logp
        hooks.mark("forward2_start")
        with hooks.segment():
            logp = token_logprobs(model, ids)
            hooks.mark("forward2_end")
            policy_loss(logp, advantages).backward()
            del logp
    else:
        block = (
            no_reshard_between_backwards(
                model,
                keep_unsharded=mode.name == "keep",
                sync_grads=mode.sync_grads,
                backwards=BACKWARDS,
            )
            if mode.uses_library
            else contextlib.nullcontext()
        )
        with hooks.segment(), block:
            logp = token_logprobs(model, ids)
            logprob_loss(logp).backward(retain_graph=True)
            policy_loss(logp, advantages).backward()
            del logp
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# Memory breakdown at the peak #
_BUCKETS = {
    "Sharded Param": "sharded_params",
    "Parameter": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "All Gather": "unsharded_params",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Reduce Scatter": "grads",
    "Gradient": "grads",
    "Activation": "activations",
}
BREAKDOWN_KEYS = ("sharded_params", "unsharded_params", "grads", "activations", "other")


def _collective_kind(func) -> str | None:
    from ._measure import _KINDS

    packet = getattr(func, "_overloadpacket", None)
    if packet is None:
        return None
    name = str(packet).split(".")[-1].lower()
    for kind, needles in _KINDS.items():
        if any(needle in name for needle in needles):
            return kind
    return None


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _tracker_classes():
    """``(FSDP2 tracker class or None, generic tracker class)``, built on torch's trackers.

    Both remember which storages were alive at the peak, so a label given
    later (an unsharded gradient is only recognised when it is reduced)
    still counts for the peak.
    """
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except ImportError as exc:
        raise RuntimeError(
            "memory report: torch.distributed._tools.mem_tracker.MemTracker is missing "
            f"in torch {__import__('torch').__version__}"
        ) from exc

    class PeakLive:
        def _init_peak_live(self) -> None:
            self.peak_live: dict[Any, list[tuple[Any, int]]] = {}

        def _update_peak_stats(self, peak_state) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            for dev, total in self._peak_mem.items():
                if total != before.get(dev):
                    self.peak_live[dev] = [
                        (winfo, winfo.mem_consumed)
                        for winfo, _ in list(self._WINFO.values())
                        if winfo.device == dev and winfo.mem_consumed > 0
                    ]

        def peak_breakdown(self, device_type: str) -> tuple[int, dict, dict]:
            """``(peak bytes, breakdown by BREAKDOWN_KEYS, by tracker category)``."""
            live = [
                entry
                for dev, entries in self.peak_live.items()
                if dev.type == device_type
                for entry in entries
            ]
            buckets: Counter = Counter(dict.fromkeys(BREAKDOWN_KEYS, 0))
            detail: Counter = Counter()
            for winfo, mem in live:
                label = getattr(winfo, "report_label", None) or str(winfo.reftype.value)
                bucket = getattr(winfo, "report_bucket", None) or _BUCKETS.get(label, "other")
                buckets[bucket] += mem
                detail[label] += mem
            return sum(buckets.values()), dict(buckets), dict(detail)

    class GenericTracker(PeakLive, MemTracker):
        """``MemTracker`` for any FSDP: parameters registered up front as sharded;
        all-gather outputs count as unsharded parameters, reduced tensors as grads."""

        def __init__(self, model, optimizer, inputs) -> None:
            super().__init__()
            self._init_peak_live()
            for param in model.parameters():
                self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
            for buffer in model.buffers():
                self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
            for state in optimizer.state.values():
                for value in _tensors(list(state.values())):
                    self._update_and_maybe_create_winfos(value, _MemRefType.OPT)
            for tensor in _tensors(list(inputs)):
                self._update_and_maybe_create_winfos(tensor, _MemRefType.OTH)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # Registered in __init__; FSDP points parameters at unsharded
            # storage during forward, which must not be relabelled.
            return 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented:
                return out
            kind = _collective_kind(func)
            if kind == "all_gather":
                sides = [_tensors(a) for a in (*args, out)]
                largest = max(sides, key=lambda ts: sum(t.numel() * t.element_size() for t in ts))
                self._label(largest, _MemRefType.PARAM, "unsharded_params", "All-gathered Param")
            elif kind is not None:
                self._label(_tensors(list(args)), _MemRefType.GRAD, "grads", "Reduced Grad")
            return out

        def _label(self, tensors, reftype, bucket: str, label: str) -> None:
            for tensor in tensors:
                for winfo in self._update_and_maybe_create_winfos(tensor, reftype):
                    winfo.report_bucket = bucket
                    winfo.report_label = label

    GenericTracker.torch_tool = "MemTracker"
    fsdp2_tracker = None
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        class FSDP2Tracker(PeakLive, FSDPMemTracker):
            def __init__(self, model, optimizer, inputs) -> None:
                super().__init__(model, optimizer)
                self._init_peak_live()
                self.track_inputs(tuple(inputs))

        FSDP2Tracker.torch_tool = "FSDPMemTracker"
        fsdp2_tracker = FSDP2Tracker
    except ImportError:
        pass
    return fsdp2_tracker, GenericTracker


def make_tracker(model, optimizer, batch, backend: str):
    fsdp2_tracker, generic = _tracker_classes()
    cls = fsdp2_tracker if backend == "fsdp2" and fsdp2_tracker is not None else generic
    return cls(model, optimizer, batch)


class _TrackerHooks(StepHooks):
    """Lets torch's trackers see a second forward of the root within one step."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        self.tracker.reset_mod_stats()
        yield


class _CountHooks(StepHooks):
    """Counts collectives per forward (``CommDebugMode`` cannot see two forwards at once)."""

    def __init__(self) -> None:
        self.parts: list[Any] = []

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        from ._measure import count_collectives

        with count_collectives() as counts:
            yield
        self.parts.append(counts)

    def totals(self) -> dict[str, int]:
        total: Counter = Counter()
        for part in self.parts:
            total.update({k: v for k, v in part.as_dict().items()})
            total.update({f"{k}_bytes": v for k, v in part.bytes_dict().items()})
        return dict(total)


class _TimeHooks(StepHooks):
    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.stamps: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.sync()
        self.stamps[name] = time.perf_counter()


# One backend on one rank #
_START = time.monotonic()


def _say(message: str) -> None:
    print(f"[report {time.monotonic() - _START:6.0f}s] {message}", flush=True)


def _short_error() -> str:
    exc = sys.exc_info()[1]
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:500]


class _BackendRun:
    """Builds the model once per backend (again after a failure) and runs every mode."""

    def __init__(self, cfg: ReportConfig, backend: str, device, rank: int, world: int,
                 *, mesh=None, single_process: bool = False) -> None:
        self.cfg, self.backend, self.device = cfg, backend, device
        self.rank, self.world = rank, world
        self.mesh = mesh  # given when simulating: it cannot be made under fake tensors
        self.single_process = single_process
        self.modes = cfg.mode_list()
        self.results: dict[str, dict[str, Any]] = {
            m.label: {"error": None, "times": [], "forward2_times": []} for m in self.modes
        }
        self.model = self.optimizer = None
        self.batch = make_batch(cfg, rank, device)
        self.meta: dict[str, Any] = {}
        self.rebuilt = False  # the model was rebuilt after a failure

    # bookkeeping
    def log(self, message: str) -> None:
        if self.rank == 0:
            _say(f"{self.backend} {message}")

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def agree(self, error: str | None) -> str | None:
        """The first rank's error, if any rank had one (all ranks get the same answer)."""
        import torch.distributed as dist

        if self.single_process:
            return error
        errors: list[str | None] = [None] * self.world
        dist.all_gather_object(errors, error)
        for rank, err in enumerate(errors):
            if err:
                return err if self.world == 1 else f"rank {rank}: {err}"
        return None

    def build(self) -> None:
        import torch

        self.model = self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # after an out-of-memory failure
        model = build_model(self.cfg, self.device)
        self.meta.setdefault("param_count", sum(p.numel() for p in model.parameters()))
        self.meta.setdefault("unsharded_param_bytes", param_bytes(model))
        mesh = self.mesh
        if self.backend == "fsdp2" and mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device.type, (self.world,))
        self.model = wrap(model, self.backend, self.device, mesh)
        self.meta["fsdp_units"] = fsdp_units(self.model, self.backend)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-5)

    def fail(self, mode: Mode, error: str, where: str) -> None:
        self.rebuilt = True
        self.results[mode.label]["error"] = f"{where}: {error}"
        hint = "" if os.environ.get(_TRACEBACKS_ENV) else f" (tracebacks: {_TRACEBACKS_ENV}=1)"
        self.log(f"{mode.label}: FAILED in {where}: {error}{hint}")
        self.build()  # the failed step may have left FSDP mid-backward

    def ok_modes(self) -> list[Mode]:
        return [m for m in self.modes if self.results[m.label]["error"] is None]

    def guarded(self, mode: Mode, where: str, fn: Callable[[], None]) -> bool:
        error = None
        try:
            fn()
        except Exception:  # noqa: BLE001 - a mode's failure is a result
            error = _short_error()
            if os.environ.get(_TRACEBACKS_ENV):
                traceback.print_exc()
        error = self.agree(error)
        if error is not None:
            self.fail(mode, error, where)
            return False
        return True

    # phases
    def run(self) -> None:
        try:
            self.build()
        except Exception:  # noqa: BLE001 - every row records it
            error = self.agree(_short_error())
            for mode in self.modes:
                self.results[mode.label]["error"] = f"setup: {error}"
            self.log(f"setup FAILED: {error}")
            return
        self.log(
            f"{self.meta['fsdp_units']} FSDP units, {self.meta['param_count'] / 1e6:.1f}M params, "
            f"world size {self.world}"
        )
        for mode in self.modes:
            self.log(f"{mode.label}: {self.cfg.warmup} warm-up step(s)")
            self.guarded(mode, "warm-up", lambda m=mode: self.steps(m, max(self.cfg.warmup, 1)))
        self.time_modes()
        for mode in self.ok_modes():
            self.log(f"{mode.label}: counting collectives")
            self.guarded(mode, "counting", lambda m=mode: self.count(m))
        for mode in self.ok_modes():
            self.log(f"{mode.label}: measuring memory")
            self.guarded(mode, "memory", lambda m=mode: self.memory(m))

    def steps(self, mode: Mode, n: int) -> None:
        for _ in range(n):
            train_step(self.model, self.optimizer, self.batch, mode)

    def time_modes(self) -> None:
        """Round-robin over the modes so that load changes hit all of them alike."""
        plain = [(m, False) for m in self.ok_modes()]
        marked = [(m, True) for m, _ in plain if m.name == "two_forward"]
        entries = plain + marked
        if self.rebuilt:  # modes warmed up before the rebuild need one more step
            self.log("one more untimed step per mode (the model was rebuilt)")
            for mode, _ in plain:
                self.guarded(mode, "warm-up", lambda m=mode: self.steps(m, 1))
        self.log(f"timing {self.cfg.steps} interleaved steps of {len(plain)} mode(s)")
        for step in range(self.cfg.steps):
            for mode, with_marks in list(entries):
                if self.results[mode.label]["error"] is not None:
                    continue
                error = None
                try:
                    self.timed_step(mode, with_marks)
                except Exception:  # noqa: BLE001
                    error = _short_error()
                error = self.agree(error)
                if error is not None:
                    self.fail(mode, error, "timing")
            if self.rank == 0 and (step + 1) % max(1, self.cfg.steps // 4) == 0:
                done = ", ".join(
                    f"{m.label} {1e3 * statistics.median(self.results[m.label]['times']):.1f} ms"
                    for m, _ in plain
                    if self.results[m.label]["times"]
                )
                self.log(f"  step {step + 1}/{self.cfg.steps}: median so far {done}")

    def timed_step(self, mode: Mode, with_marks: bool) -> None:
        hooks = _TimeHooks(self.sync) if with_marks else _NO_HOOKS
        self.sync()
        start = time.perf_counter()
        train_step(self.model, self.optimizer, self.batch, mode, hooks)
        self.sync()
        elapsed = time.perf_counter() - start
        result = self.results[mode.label]
        if with_marks:
            result["forward2_times"].append(
                hooks.stamps["forward2_end"] - hooks.stamps["forward2_start"]
            )
        else:
            result["times"].append(elapsed)

    def count(self, mode: Mode) -> None:
        hooks = _CountHooks()
        train_step(self.model, self.optimizer, self.batch, mode, hooks)
        self.results[mode.label]["counts"] = hooks.totals()

    def memory(self, mode: Mode) -> None:
        import torch

        result = self.results[mode.label]
        if self.device.type == "cuda":
            self.sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            train_step(self.model, self.optimizer, self.batch, mode)
            self.sync()
            result["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            result["memory_source"] = "torch.cuda.max_memory_allocated"
        if self.device.type != "cuda":
            self.tracked_step(mode)
            return
        # On GPU the peak above stands even if torch's tracker fails on this version.
        error = None
        try:
            self.tracked_step(mode)
        except Exception:  # noqa: BLE001
            error = _short_error()
        error = self.agree(error)
        if error is not None:
            result["breakdown_error"] = error
            self.log(f"{mode.label}: no breakdown: {error}")
            self.build()

    def tracked_step(self, mode: Mode) -> None:
        result = self.results[mode.label]
        tracker = make_tracker(self.model, self.optimizer, self.batch, self.backend)
        with tracker:
            train_step(self.model, self.optimizer, self.batch, mode, _TrackerHooks(tracker))
        peak, breakdown, detail = tracker.peak_breakdown(self.device.type)
        result["tracker"] = tracker.torch_tool
        result["tracker_peak_bytes"] = peak
        result["breakdown"] = breakdown
        result["breakdown_detail"] = detail
        if self.device.type != "cuda":
            result["peak_bytes"] = peak
            result["memory_source"] = result["tracker"]


# Rows #
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _merge_ranks(cfg: ReportConfig, backend: str, per_rank: list[dict], meta: dict,
                 world: int, simulated: bool) -> list[dict[str, Any]]:
    """One row per mode from every rank's results (peaks: the largest rank)."""
    rows = []
    for mode in cfg.mode_list():
        results = [r[mode.label] for r in per_rank]
        first = results[0]
        error = next((r["error"] for r in results if r.get("error")), None)
        row: dict[str, Any] = {
            "mode": mode.name,
            "label": mode.label,
            "backend": backend,
            "sync_grads": mode.sync_grads,
            "keep_unsharded": {"keep": True, "regather": False}.get(mode.name),
            "backwards": BACKWARDS if mode.uses_library else None,
            "ok": error is None,
            "error": error,
            "world_size": world,
            "simulated": simulated,
            "fsdp_units": meta.get("fsdp_units"),
            "peak_bytes": None,
            "peak_bytes_per_rank": None,
            "memory_source": first.get("memory_source"),
            "tracker_peak_bytes": None,
            "breakdown": None,
            "breakdown_detail": None,
            "breakdown_error": None,
            "step_time_s": None,
            "timed_steps": 0,
            "forward2_time_s": None,
            "all_gathers_per_step": None,
            "reduce_scatters_per_step": None,
            "all_reduces_per_step": None,
            "all_gather_bytes_per_step": None,
            "reduce_scatter_bytes_per_step": None,
        }
        if error is None:
            peaks = [r.get("peak_bytes") for r in results]
            if all(p is not None for p in peaks):
                top = max(range(len(peaks)), key=lambda i: peaks[i])
                row.update(
                    peak_bytes=peaks[top],
                    peak_bytes_per_rank=peaks,
                    tracker_peak_bytes=results[top].get("tracker_peak_bytes"),
                    breakdown=results[top].get("breakdown"),
                    breakdown_detail=results[top].get("breakdown_detail"),
                    breakdown_error=results[top].get("breakdown_error"),
                )
            # A step ends when its slowest rank does.
            times = [max(ts) for ts in zip(*(r["times"] for r in results))]
            forward2 = [max(ts) for ts in zip(*(r["forward2_times"] for r in results))]
            row.update(step_time_s=_median(times), timed_steps=len(times),
                       forward2_time_s=_median(forward2))
            counts = first.get("counts")
            if counts is not None:
                row.update(
                    all_gathers_per_step=counts.get("all_gather", 0),
                    reduce_scatters_per_step=counts.get("reduce_scatter", 0),
                    all_reduces_per_step=counts.get("all_reduce", 0),
                    all_gather_bytes_per_step=counts.get("all_gather_bytes", 0),
                    reduce_scatter_bytes_per_step=counts.get("reduce_scatter_bytes", 0),
                )
        rows.append(row)
    return rows


def memory_bound(row: dict, baseline_peak: int, unsharded_bytes: int) -> tuple[int | None, str]:
    """The most memory ``row``'s mode may add over ``two_forward``, and why.

    ``keep``: the unsharded parameters of all units (kept from forward to the
    last backward) +10%; with ``sync_grads="last"`` also their unsharded
    gradients, which wait for the last backward. ``regather``: 5% of the
    ``two_forward`` peak.
    """
    if row["mode"] == "keep":
        if row["sync_grads"] == "last":
            return (int((1 + KEEP_SLACK) * 2 * unsharded_bytes),
                    "unsharded params + unsharded grads of all units +10%")
        return int((1 + KEEP_SLACK) * unsharded_bytes), "unsharded params of all units +10%"
    if row["mode"] == "regather":
        return int(REGATHER_SLACK * baseline_peak), "5% of two_forward peak"
    return None, ""


def add_comparisons(rows: list[dict], unsharded_bytes: int) -> None:
    """Fills savings and overheads against the ``two_forward`` row of each backend."""
    for row in rows:
        base = next((r for r in rows if r["backend"] == row["backend"]
                     and r["mode"] == "two_forward" and r["world_size"] == row["world_size"]), None)
        row.update(time_ratio=None, saved_time_s=None, ideal_saving_s=None,
                   share_of_ideal_saving=None, memory_overhead_bytes=None,
                   memory_bound_bytes=None, memory_bound=None, within_bound=None)
        if base is None or not base["ok"] or not row["ok"]:
            continue
        if row["step_time_s"] is not None and base["step_time_s"]:
            saved = base["step_time_s"] - row["step_time_s"]
            ideal = base["forward2_time_s"]
            row.update(
                time_ratio=row["step_time_s"] / base["step_time_s"],
                saved_time_s=saved,
                ideal_saving_s=ideal,
                share_of_ideal_saving=saved / ideal if ideal else None,
            )
        if row["peak_bytes"] is not None and base["peak_bytes"] is not None:
            overhead = row["peak_bytes"] - base["peak_bytes"]
            bound, why = memory_bound(row, base["peak_bytes"], unsharded_bytes)
            row.update(memory_overhead_bytes=overhead, memory_bound_bytes=bound,
                       memory_bound=why or None,
                       within_bound=None if bound is None else overhead <= bound)


def _config_dict(cfg: ReportConfig, world: int, meta: dict, device) -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    dims = cfg.dims()
    out = {
        "command": cfg.command,
        "backends": list(cfg.backends),
        "modes": list(cfg.modes),
        "device": str(device.type),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"cpu ({os.cpu_count()} cores)"),
        "process_group": ("fake" if cfg.simulate_world_size
                          else "nccl" if device.type == "cuda" else "gloo"),
        "world_size": world,
        "simulated": bool(cfg.simulate_world_size),
        "dtype": cfg.dtype,
        "size": cfg.size,
        "model": "Qwen2ForCausalLM (random weights)",
        **{k: dims[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")},
        "tie_word_embeddings": dims["tie"],
        "seq_len": dims["seq_len"],
        "batch_per_rank": dims["batch"],
        "param_count": meta.get("param_count"),
        "unsharded_param_bytes": meta.get("unsharded_param_bytes"),
        "backwards_per_step": BACKWARDS,
        "warmup_steps": cfg.warmup,
        "timed_steps": 0 if cfg.simulate_world_size else cfg.steps,
        "optimizer": "SGD(lr=1e-5)",
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return out


# Entry points #
def _quiet_known_warnings() -> None:
    for message in (
        "Full backward hook is firing",
        ".*returned a view tensor",
        "FSDP is switching to use `NO_SHARD`",
        "The module hierarchy tracking maybe be messed up",
        "For backward hooks to be called, module output should be a Tensor",
    ):
        warnings.filterwarnings("ignore", message=message)


def _worker(cfg: ReportConfig) -> dict | None:
    """Runs on every rank (under torchrun or as launched by ``run_report``)."""
    import torch
    import torch.distributed as dist

    _quiet_known_warnings()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        if cfg.steps < MIN_TIMED_STEPS and rank == 0:
            _say(f"note: {cfg.steps} timed steps (< {MIN_TIMED_STEPS}): timings are rough")
        rows, meta = [], {}
        for backend_name in cfg.backends:
            run = _BackendRun(cfg, backend_name, device, rank, world)
            run.run()
            gathered: list[dict | None] = [None] * world
            dist.all_gather_object(gathered, run.results)
            rows += _merge_ranks(cfg, backend_name, gathered, run.meta, world, False)
            meta = {**run.meta, **meta}
            del run
            gc.collect()
        report = None
        if rank == 0:
            report = _finish(cfg, rows, meta, world, device)
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()


def _finish(cfg: ReportConfig, rows: list[dict], meta: dict, world: int, device) -> dict:
    add_comparisons(rows, meta.get("unsharded_param_bytes") or 0)
    report = {"config": _config_dict(cfg, world, meta, device), "rows": rows}
    from ._report_output import write_report

    paths = write_report(report, Path(cfg.out))
    print(paths["md_text"], flush=True)
    _say("wrote " + ", ".join(str(p) for k, p in paths.items() if k != "md_text"))
    return report


def _simulate(cfg: ReportConfig) -> dict:
    """Per-rank memory for ``cfg.simulate_world_size`` ranks, in this process."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        raise RuntimeError(
            f"--simulate-world-size needs torch's fake process group, missing in torch "
            f"{torch.__version__}"
        ) from exc
    _quiet_known_warnings()
    world = cfg.simulate_world_size
    if world is None or world < 1:
        raise ValueError(f"--simulate-world-size must be >= 1, got {world}")
    if dist.is_initialized():
        raise ValueError("--simulate-world-size runs in one process: do not use torchrun")
    device = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    rows, meta = [], {}
    try:
        for backend in cfg.backends:
            _say(f"{backend}: simulating {world} ranks with fake tensors")
            mesh = init_device_mesh("cpu", (world,))  # not under FakeTensorMode
            run = _BackendRun(cfg, backend, device, 0, world, mesh=mesh, single_process=True)
            with FakeTensorMode():
                run.batch = make_batch(cfg, 0, device)
                _simulate_backend(run)
            rows += _merge_ranks(cfg, backend, [run.results], run.meta, world, True)
            meta = {**run.meta, **meta}
            del run
            gc.collect()
    finally:
        dist.destroy_process_group()
    return _finish(cfg, rows, meta, world, device)


def _simulate_backend(run: _BackendRun) -> None:
    try:
        run.build()
        run.log(f"{run.meta['fsdp_units']} FSDP units, {run.meta['param_count'] / 1e6:.1f}M params")
        run.log("warm-up step (two_forward)")
        run.steps(Mode("two_forward"), 1)
    except Exception:  # noqa: BLE001 - every row records it
        error = _short_error()
        for mode in run.modes:
            run.results[mode.label]["error"] = f"setup: {error}"
        run.log(f"setup FAILED: {error}")
        return
    for mode in run.modes:
        run.log(f"{mode.label}: measuring memory")
        run.guarded(mode, "memory", lambda m=mode: run.memory(m))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(cfg: ReportConfig, world: int) -> dict:
    """Spawns ``world`` ranks of this module; rank 0 prints progress here."""
    root = str(Path(__file__).resolve().parent.parent)
    port = _free_port()
    logdir = Path(tempfile.mkdtemp(prefix="fsdp_retain_report_"))
    threads = max(1, (os.cpu_count() or 1) // world)
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p]),
            PYTHONUNBUFFERED="1",
        )
        env[_CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))
        if cfg.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(threads))
        log = None if rank == 0 else open(logdir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fsdp_retain._report"], cwd=root, env=env,
            stdout=log, stderr=subprocess.STDOUT if log else None,
        ))
    deadline = time.monotonic() + cfg.timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [p.returncode for p in procs]
    tails = []
    for rank, log in enumerate(logs):
        if log is not None:
            log.seek(0)
            tails.append(f"----- rank {rank} (exit {codes[rank]}) -----\n{log.read()[-4000:]}")
            log.close()
    path = Path(cfg.out) / "report.json"
    if any(codes) or not path.exists():
        raise RuntimeError(f"report ranks failed (exit codes {codes})\n" + "\n".join(tails))
    return json.loads(path.read_text())


def run_report(cfg: ReportConfig) -> dict:
    """Runs the report as ``cfg`` says and returns what ``report.json`` holds.

    Launches ``cfg.nproc`` ranks itself unless it already runs as one rank
    (under ``torchrun``: then it returns the report on rank 0 and ``{}``
    elsewhere); ``cfg.simulate_world_size`` runs in this process.

    Example::

        from fsdp_retain._report import ReportConfig, run_report

        report = run_report(ReportConfig(backends=("fsdp2",), size="tiny", out="out"))
        print([(r["label"], r["peak_bytes"]) for r in report["rows"]])
    """
    if cfg.simulate_world_size:
        return _simulate(cfg)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _worker(cfg) or {}
    world = cfg.world_size()
    if world == 1:
        env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return _worker(cfg) or {}
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return _launch(cfg, world)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    run_report(cfg)
    return 0


def _rank_main() -> int:
    cfg = ReportConfig(**json.loads(os.environ[_CONFIG_ENV]))
    _worker(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main() if _CONFIG_ENV in os.environ else main())
