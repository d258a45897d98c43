"""The command line: ``python -m fsdp_retain.report`` (and ``scripts/memory_report.py``)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from ._config import ALL_BACKENDS, BACKENDS, DIM_FLAGS, DTYPES, FSDP1_SHARDING, MIN_TIMED_STEPS, SIZES, ReportConfig
from ._fit import parse_bytes
from ._deps import MissingDependency, check_dependencies
from ._launch import run_report
from ._modes import DEFAULT_MODES, mode_labels
from ._results import unexpected_failures

PROG = "-m fsdp_retain.report"  # what follows ``python`` (or ``torchrun ...``) in a command


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python {prog}",
        description=(
            "Peak memory, step time and collectives of fsdp_retain's modes against a "
            "second forward, on a Qwen2-shaped causal LM (or the model of a config.json) with "
            "random weights. Writes report.json, report.md, report.png and (timed runs) "
            "tradeoff.png into --out; python -m fsdp_retain.report.figures redraws the figures."
        ),
        epilog=(f"The largest keep_unsharded budget for your model: python {prog} fit "
                "--model-config config.json --world-size 64 --gpu-memory 80GiB --dtype bf16 "
                f"(python {prog} fit --help). This machine's speed, to quote beside CPU "
                f"times: python {prog} calibrate."),
    )
    parser.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=ALL_BACKENDS,
                        help="backends to run, in order (default: fsdp2 fsdp1; deepspeed: "
                        "ZeRO-3, needs deepspeed installed; ddp: DistributedDataParallel, "
                        "the modes that only change keep_unsharded or reshard_to are n/a)")
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES),
                        help=" ".join(mode_labels()) + " (regather_node: keep_unsharded=False "
                        "with reshard_to=<--node-size>, FSDP2 only; needs --node-size), or an "
                        "option fit prints: keep_unsharded=<bytes>[,reshard_to=<N>]:every")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: gloo; cuda: NCCL, one GPU per rank")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to launch (cpu: 2, cuda: all GPUs); ignored under torchrun")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                        help="parameter (and gradient) dtype")
    parser.add_argument("--size", default=None, choices=list(SIZES),
                        help="Qwen2.5-shaped model preset (default: small); the flags below "
                             "override its fields")
    parser.add_argument("--model-config", default=None, metavar="PATH",
                        help="instead of --size: a Hugging Face causal LM config.json (or its "
                             "folder), built with random weights, nothing downloaded; the flags "
                             "below override its fields")
    for name in DIM_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, dest=name)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--steps", type=int, default=MIN_TIMED_STEPS,
                        help=f"timed steps per mode (median; use >= {MIN_TIMED_STEPS})")
    parser.add_argument("--simulate-world-size", type=int, default=None,
                        help="estimate per-rank memory for N ranks in this process (fake process "
                             "group and fake tensors; memory only)")
    parser.add_argument("--node-size", type=int, default=None, metavar="N",
                        help="ranks per node (a divisor of the world size, >= 2): the "
                        "reshard_to of mode regather_node, and the all-gathers on groups of "
                        "more than N ranks count as inter-node. Not read from the launcher: "
                        "give it on real launches too")
    parser.add_argument("--fsdp1-sharding", default="FULL_SHARD", choices=FSDP1_SHARDING,
                        help="--backend fsdp1's ShardingStrategy (default FULL_SHARD); "
                        "HYBRID_SHARD shards over the --node-size ranks of a node and "
                        "replicates across nodes")
    parser.add_argument("--ddp-bucket-cap-mb", type=float, default=None, metavar="MIB",
                        help="--backend ddp: DDP's bucket_cap_mb (default: DDP's 25); the "
                        "all-reduces per step are counted per bucket")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="non-reentrant activation checkpointing on every decoder layer")
    parser.add_argument("--compile-layers", nargs="?", const="inductor", default=None,
                        metavar="BACKEND",
                        help="torch.compile each decoder layer (with BACKEND, default "
                        "inductor) before fully_shard, as torchtitan does (--backend fsdp2); "
                        "the library needs torch._functorch.config.donated_buffer = False, "
                        "which the report sets")
    parser.add_argument("--gpu-memory", nargs="+", default=[], metavar="SIZE",
                        help="e.g. 80GiB 141GiB: also print the largest keep_unsharded budget among "
                        "the modes run (regather, keep25/50/75, keep) whose peak fits")
    parser.add_argument("--out", default="report_out", help="output directory")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before a launch or a collective gives up")
    return parser


def parse_args(argv: list[str] | None = None, *, prog: str = PROG) -> ReportConfig:
    """The ``ReportConfig`` a command line asks for (``--help`` lists the flags).

    Example::

        cfg = parse_args(["--simulate-world-size", "8", "--size", "7b", "--dtype", "bf16"])
    """
    parser = _parser(prog)
    return _config(parser, parser.parse_args(argv), argv, prog)


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace,
            argv: list[str] | None, prog: str) -> ReportConfig:
    if args.size is not None and args.model_config is not None:
        parser.error("use --size or --model-config, not both")
    raw = sys.argv[1:] if argv is None else argv
    launcher = "python"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', '?')}"
    try:
        return _make_config(args, f"{launcher} {prog} {shlex.join(raw)}".strip())
    except ValueError as exc:  # a flag's value: usage and the message, exit status 2
        parser.error(str(exc))


def _make_config(args: argparse.Namespace, command: str) -> ReportConfig:
    return ReportConfig(
        backends=tuple(args.backend),
        modes=tuple(args.modes),
        device=args.device,
        nproc=args.nproc,
        dtype=args.dtype,
        size=args.size or "small",
        model_config=args.model_config,
        warmup=args.warmup,
        steps=args.steps,
        simulate_world_size=args.simulate_world_size,
        out=args.out,
        seed=args.seed,
        timeout=args.timeout,
        command=command,
        activation_checkpointing=args.activation_checkpointing,
        compile_layers=args.compile_layers,
        gpu_memory=tuple(parse_bytes(size) for size in args.gpu_memory),
        node_size=args.node_size,
        ddp_bucket_cap_mb=args.ddp_bucket_cap_mb,
        fsdp1_sharding=args.fsdp1_sharding,
        **{name: getattr(args, name) for name in DIM_FLAGS},
    )



def main(argv: list[str] | None = None, *, prog: str = PROG) -> int:
    """Runs the report a command line asks for; ``prog`` names the entry point in the command.

    Returns 0 when every requested row was produced, 1 when a row failed (other than
    an expected crash, such as plain FSDP1's ``naive`` row), 2 when a dependency is
    missing (checked before anything runs; the message names the extra to install).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fit"]:
        from ._fit_cli import main as fit_main

        return fit_main(argv[1:], prog=f"python {prog} fit")
    if argv == ["calibrate"]:
        from ._calibrate import main as calibrate_main

        return calibrate_main()
    parser = _parser(prog)
    args = parser.parse_args(argv)  # --help needs no extra
    try:
        check_dependencies()  # --model-config needs transformers to read the config
        cfg = _config(parser, args, argv, prog)
        check_dependencies(cfg.backends)
    except MissingDependency as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    report = run_report(cfg)
    failed = unexpected_failures(report)
    if failed:
        print(f"error: {len(failed)} requested row(s) could not be produced: "
              + "; ".join(f"{r.backend} {r.label}: {r.error}" for r in failed),
              file=sys.stderr, flush=True)
        return 1
    return 0
