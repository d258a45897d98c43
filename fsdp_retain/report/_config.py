"""What a report run measures: ``ReportConfig`` and the model presets."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._hf_config import config_dims
from ._modes import DEFAULT_MODES, Mode

BACKENDS = ("fsdp2", "fsdp1")  # the default
# deepspeed: ZeRO-3, needs deepspeed installed; ddp: DistributedDataParallel (nothing sharded).
ALL_BACKENDS = BACKENDS + ("deepspeed", "ddp")
MIN_TIMED_STEPS = 10

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
    "14b": dict(layers=48, hidden=5120, intermediate=13824, heads=40, kv_heads=8,
                vocab=152064, tie=False, seq_len=2048, batch=1),
    "32b": dict(layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8,
                vocab=152064, tie=False, seq_len=2048, batch=1),
}
DIM_FLAGS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq_len", "batch")
FSDP1_SHARDING = ("FULL_SHARD", "HYBRID_SHARD")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass
class ReportConfig:
    """Everything a report run needs; ``parse_args`` builds one from the CLI.

    The model is the preset ``size`` or, with ``model_config``, the causal LM
    of a Hugging Face ``config.json`` (a local file or its folder; random
    weights, nothing downloaded). The dimension fields (``layers``, ``hidden``,
    ..., ``seq_len``, ``batch``) override either.

    Example::

        from fsdp_retain.report import ReportConfig, run_report

        cfg = ReportConfig(model_config="Qwen2.5-7B/config.json", simulate_world_size=8,
                           dtype="bf16", batch=2, seq_len=2048, out="out")
        report = run_report(cfg)
    """

    backends: tuple[str, ...] = BACKENDS
    modes: tuple[str, ...] = DEFAULT_MODES
    device: str = "cpu"
    nproc: int | None = None  # ranks: cpu 2, cuda all visible GPUs
    dtype: str = "fp32"
    size: str = "small"
    model_config: str | None = None
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
    activation_checkpointing: bool = False  # non-reentrant, on every decoder layer
    # torch.compile each decoder layer with this backend before fully_shard, as torchtitan
    # does (FSDP2 only; None: eager).
    compile_layers: str | None = None
    gpu_memory: tuple[int, ...] = ()  # bytes per rank: print the largest budget that fits
    # Ranks per node: regather_node's reshard_to, and which all-gathers leave a node.
    node_size: int | None = None
    ddp_bucket_cap_mb: float | None = None  # ddp: DDP's bucket_cap_mb (None: its 25)
    # fsdp1's ShardingStrategy: HYBRID_SHARD shards over the node_size ranks of a node and
    # replicates across nodes (a device_mesh of shape (world / node_size, node_size)).
    fsdp1_sharding: str = "FULL_SHARD"

    def __post_init__(self) -> None:
        self.backends = tuple(self.backends)
        self.modes = tuple(self.modes)
        for backend in self.backends:
            if backend not in ALL_BACKENDS:
                raise ValueError(
                    f"unknown backend {backend!r}: use fsdp1, fsdp2, deepspeed and/or ddp")
        real_only = [b for b in self.backends if b in ("deepspeed", "ddp")]
        if real_only and self.simulate_world_size is not None:
            raise ValueError(f"--simulate-world-size runs fsdp1 and fsdp2 only, not "
                             f"{real_only[0]}: drop --backend {real_only[0]}")
        labels = [Mode.parse(m).label for m in self.modes]
        if "two_forward" not in labels:
            raise ValueError("modes must include two_forward: savings and overheads are against it")
        self.modes = tuple(labels)
        self.check_node_size(self.simulate_world_size or self.nproc)
        if self.compile_layers and (set(self.backends) != {"fsdp2"} or self.simulate_world_size):
            raise ValueError("--compile-layers compiles each decoder layer before fully_shard, "
                             "as torchtitan does: run it with --backend fsdp2 alone, on real "
                             "ranks (no --simulate-world-size)")
        self.check_fsdp1_sharding()
        if self.ddp_bucket_cap_mb is not None and not self.ddp_bucket_cap_mb > 0:
            raise ValueError(f"--ddp-bucket-cap-mb must be > 0 (MiB), got {self.ddp_bucket_cap_mb}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {sorted(SIZES)}, got {self.size!r}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("steps must be >= 1 and warmup >= 0")
        if self.simulate_world_size is not None and self.simulate_world_size < 1:
            raise ValueError(
                f"simulate_world_size must be >= 1, got {self.simulate_world_size}")
        dims = self.dims()
        if dims["hidden"] % dims["heads"] or dims["heads"] % dims["kv_heads"]:
            raise ValueError(
                f"hidden ({dims['hidden']}) must divide by heads ({dims['heads']}) and "
                f"heads by kv_heads ({dims['kv_heads']})"
            )

    def check_node_size(self, world: int | None) -> None:
        """Raises ``ValueError`` when a mode needs ``node_size`` and it is missing, or it
        does not divide ``world`` (``None``: not known yet, e.g. one rank per GPU)."""
        size = self.node_size
        needs = [m.label for m in self.mode_list() if m.spec.node_groups]
        if size is None:
            if needs:
                raise ValueError(
                    f"mode {needs[0]} reshards to the ranks of one node: pass --node-size N "
                    "(e.g. --node-size 8 for 8 GPUs per node; node_size=N in ReportConfig)")
            return
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"--node-size must be an int >= 2 (the ranks of one node, e.g. "
                             f"8), got {size!r}")
        if world is not None and world % size:
            raise ValueError(
                f"--node-size {size} does not divide the world size {world}: nodes hold "
                f"equal numbers of ranks. Pass a divisor of {world} (the ranks per node), "
                f"or a world size that is a multiple of {size}")

    def check_fsdp1_sharding(self) -> None:
        """Raises ``ValueError`` for an unknown ``fsdp1_sharding``, or ``HYBRID_SHARD``
        without the ``node_size`` that makes its shard groups."""
        if self.fsdp1_sharding not in FSDP1_SHARDING:
            raise ValueError(f"--fsdp1-sharding {self.fsdp1_sharding!r}: use "
                             f"{' or '.join(FSDP1_SHARDING)}")
        if self.fsdp1_sharding == "HYBRID_SHARD" and self.node_size is None:
            raise ValueError("--fsdp1-sharding HYBRID_SHARD shards FSDP1 over the ranks of one "
                             "node: pass --node-size N (e.g. 8 GPUs per node), the size of "
                             "its shard groups")

    def dims(self) -> dict[str, Any]:
        """The model's shape, ``seq_len`` and ``batch`` (per rank), flags applied."""
        if self.model_config is not None:
            dims = config_dims(self.model_config)
        else:
            dims = dict(SIZES[self.size])
        for name in DIM_FLAGS:
            if getattr(self, name) is not None:
                dims[name] = getattr(self, name)
        return dims

    def mode_list(self) -> list[Mode]:
        return [Mode.parse(m, node_size=self.node_size) for m in self.modes]

    def world_size(self) -> int:
        if self.nproc is not None:
            return self.nproc
        if self.device == "cuda":
            import torch

            return max(torch.cuda.device_count(), 1)
        return 2
