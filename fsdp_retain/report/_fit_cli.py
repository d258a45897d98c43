"""``python -m fsdp_retain.report fit``: the largest ``keep_unsharded`` budget, one command.

Simulates one rank of ``--world-size`` (``--simulate-world-size``'s machinery: fake
process group, fake tensors, torch's memory trackers) for ``keep_unsharded=True``,
``False``, ``sync_grads="last"`` and the budgets ``BudgetSearch`` asks for, and prints
the largest budget whose peak fits in ``--gpu-memory``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING

from ._config import DIM_FLAGS, DTYPES, FSDP1_SHARDING, SIZES, ReportConfig
from ._deps import MissingDependency, check_dependencies
from ._fit import all_gathers, gathers_by_node, human_bytes, parse_bytes

if TYPE_CHECKING:
    from ._fit_sims import FitRun

PROG = "python -m fsdp_retain.report fit"
EXAMPLE = ("--model-config config.json --world-size 64 --gpu-memory 80GiB --dtype bf16 "
           "--batch 1 --seq-len 4096 --activation-checkpointing")


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "The largest keep_unsharded budget (bytes per rank) whose estimated peak fits in "
            "--gpu-memory, for your model on --world-size ranks, with the peaks of "
            "keep_unsharded=True (the default), False and sync_grads=\"last\". Estimated on "
            "this CPU: one simulated rank (fake process group and fake tensors), one FSDP unit "
            "per decoder layer plus the root, two backward passes per step. Needs "
            "transformers (the report extra)."
        ),
        epilog=f"example: {prog} {EXAMPLE}",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-config", metavar="PATH",
                       help="a Hugging Face causal LM config.json (or its folder); nothing is "
                            "downloaded, the weights are random")
    model.add_argument("--size", choices=list(SIZES), help="a Qwen2.5-shaped preset instead")
    parser.add_argument("--world-size", type=int, required=True, metavar="N",
                        help="ranks the model is sharded over")
    parser.add_argument("--gpu-memory", required=True, metavar="SIZE",
                        help="memory per GPU, e.g. 80GiB, 141GiB or 80e9 (bytes)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                        help="parameter (and gradient) dtype (default: fp32)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank (default 1)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: 2048, or the config's "
                             "max_position_embeddings if smaller)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="non-reentrant activation checkpointing on every decoder layer")
    parser.add_argument("--backend", default="fsdp2", choices=("fsdp2", "fsdp1"),
                        help="default: fsdp2 (fully_shard)")
    parser.add_argument("--node-size", type=int, default=None, metavar="N",
                        help="ranks per node: also search the budgets with reshard_to=N (the "
                             "units not kept are resharded to one node between passes, so "
                             "later passes all-gather inside it), and split all-gathers into "
                             "intra- and inter-node; FSDP1: with --fsdp1-sharding HYBRID_SHARD")
    parser.add_argument("--fsdp1-sharding", default="FULL_SHARD", choices=FSDP1_SHARDING,
                        help="with --backend fsdp1 --node-size N: HYBRID_SHARD searches the "
                             "budgets again with FSDP1 sharded over shard groups of N ranks "
                             "(one node) and replicated across nodes, beside FULL_SHARD's")
    parser.add_argument("--verbose", action="store_true",
                        help="also print this machine's calibration (its speed on a fixed "
                             "CPU workload), to compare the run time with another machine's")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="simulations run at once (default: the CPUs available, at most 4)")
    for name in DIM_FLAGS:  # --layers shown; --hidden, ... work as in the report
        if name not in ("batch", "seq_len"):
            shown = "decoder layers instead of the model's" if name == "layers" else None
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                                dest=name, help=shown or argparse.SUPPRESS)
    return parser


def main(argv: list[str], *, prog: str = PROG) -> int:
    """Runs ``fit`` for ``argv`` (what follows ``fit``). 0: answered (also when nothing
    fits), 1: a simulated step failed, 2: a bad flag or a missing dependency."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        check_dependencies()
    except MissingDependency as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        cfg, gpu_memory = _config(args, argv, prog)
        from ._model import check_model_config

        if cfg.model_config is not None:
            check_model_config(cfg)
    except ValueError as exc:
        parser.error(str(exc))
    from ._fit_sims import run_fit

    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[fit {time.monotonic() - started:5.0f}s] {message}", file=sys.stderr, flush=True)

    if args.verbose:
        from ._calibrate import calibration_line

        log(calibration_line())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jobs = args.jobs or min(cpus or 1, 4)
    try:
        found = run_fit(cfg, args.backend, gpu_memory, jobs, log, args.node_size)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    log(f"done in {time.monotonic() - started:.0f}s")
    print(render(cfg, args.backend, gpu_memory, found))
    return 0


def _config(args: argparse.Namespace, argv: list[str],
            prog: str) -> tuple[ReportConfig, int]:
    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size}: pass the number of ranks, 1 or more")
    _check_node_size(args.node_size, args.world_size, args.backend, args.fsdp1_sharding)
    gpu_memory = parse_bytes(args.gpu_memory)
    if gpu_memory <= 0:
        raise ValueError(f"--gpu-memory {args.gpu_memory}: pass the memory of one GPU, e.g. 80GiB")
    cfg = ReportConfig(
        backends=(args.backend,), modes=("two_forward",), dtype=args.dtype,
        size=args.size or "small", model_config=args.model_config,
        simulate_world_size=args.world_size, activation_checkpointing=args.activation_checkpointing,
        command=f"{prog} {shlex.join(argv)}", out=os.devnull,
        **{name: getattr(args, name) for name in DIM_FLAGS},
    )
    return cfg, gpu_memory


def _check_node_size(node: int | None, world: int, backend: str, fsdp1_sharding: str) -> None:
    if fsdp1_sharding == "HYBRID_SHARD" and (backend != "fsdp1" or node is None):
        raise ValueError("--fsdp1-sharding HYBRID_SHARD searches FSDP1 sharded over one node: "
                         "pass it with --backend fsdp1 and --node-size N (the ranks per node)")
    if node is None:
        return
    if node < 2:
        raise ValueError(f"--node-size {node}: pass the ranks of one node (2 or more, e.g. 8 "
                         "GPUs per node), or drop --node-size on one node")
    if world % node:
        raise ValueError(f"--node-size {node} does not divide --world-size {world}: pass the "
                         "ranks per node of a world made of whole nodes")
    if node >= world:
        raise ValueError(f"--node-size {node} is not smaller than --world-size {world}: every "
                         "rank is in one node, so no all-gather leaves it; drop --node-size")
    if backend == "fsdp1" and fsdp1_sharding != "HYBRID_SHARD":
        raise ValueError(f"--node-size with --backend fsdp1 and FULL_SHARD: FSDP1 reshards a "
                         "unit to every rank, so it cannot keep re-gathers inside a node. Add "
                         "--fsdp1-sharding HYBRID_SHARD to search the budgets with FSDP1 "
                         f"sharded over shard groups of {node} ranks (a device_mesh of shape "
                         f"({world // node}, {node})), or use --backend fsdp2 (reshard_to)")


def render(cfg: ReportConfig, backend: str, gpu_memory: int, found: FitRun) -> str:
    """The answer: the budget to paste, its peak and all-gathers, the other options."""
    meta, dims = found.meta, cfg.dims()
    checkpointing = "" if cfg.activation_checkpointing else "no "
    lines = [
        f"{cfg.model_config or '--size ' + cfg.size}: {meta['model_class']}, "
        f"{meta['param_count'] / 1e6:.1f}M params, {meta['fsdp_units']} FSDP units; {cfg.dtype}, "
        f"batch {dims['batch']} x {dims['seq_len']} tokens per rank, {checkpointing}activation "
        f"checkpointing, {backend.upper()} on {cfg.simulate_world_size} ranks, two backward "
        f"passes per step; GPU memory {human_bytes(gpu_memory)} per rank",
        "",
        *(_answer(found, gpu_memory) if found.node is None
          else _node_answer(found, gpu_memory, cfg.simulate_world_size or 1)),
        "",
        *(_table(found, gpu_memory) if found.node is None
          else _node_table(found, gpu_memory)),
        "",
        "Estimates (fake process group and fake tensors on this CPU): they leave out the CUDA "
        "context and allocator slack, a few GiB; the units are the report's, one per decoder "
        "layer plus the root (docs/report/README.md).",
    ]
    return "\n".join(lines)


def _answer(found: FitRun, gpu_memory: int) -> list[str]:
    search, units = found.search, found.meta["unit_bytes"]
    answer = search.answer()
    if answer is None:
        return [f"Not even keep_unsharded=False fits: its peak is "
                f"{human_bytes(found.peaks['False'])} per rank, over {human_bytes(gpu_memory)}. "
                "Use more ranks, activation checkpointing, a smaller batch or sequence, or a "
                "larger GPU, and run this again."]
    if answer >= search.total:
        return [f"keep_unsharded=True, the default, fits: every unit kept, peak "
                f"{human_bytes(found.peaks['True'])} per rank; no budget needed.",
                "", "Paste: no_reshard_between_backwards(model)"]
    peak = search.peak(answer)
    assert peak is not None
    if answer == 0:
        return ["Largest budget that fits: keep_unsharded=0",
                f"  which is keep_unsharded=False: peak {human_bytes(peak)} per rank ({peak} "
                "bytes); with any one unit kept it does not fit",
                "", "Paste: no_reshard_between_backwards(model, keep_unsharded=False)"]
    kept = search.kept(answer)
    layers = f"{len(kept - {0})} of {len(units) - 1} decoder layers{' and the root' * (0 in kept)}"
    regather = all_gathers(units, 0, frees_after_forward=True)
    gathers = all_gathers(units, answer, frees_after_forward=True)
    return [
        f"Largest budget that fits: keep_unsharded={answer}",
        f"  peak {human_bytes(peak)} per rank ({peak} bytes); keeps {layers} unsharded "
        f"({human_bytes(answer)} per rank); saves {regather - gathers} all-gathers per step "
        f"against keep_unsharded=False ({gathers} instead of {regather})",
        "", f"Paste: no_reshard_between_backwards(model, keep_unsharded={answer})",
    ]


def _table(found: FitRun, gpu_memory: int) -> list[str]:
    search, peaks, units = found.search, found.peaks, found.meta["unit_bytes"]
    answer = search.answer()
    rows: list[tuple[str, int | None, int]] = [
        ("keep_unsharded=True (the default)", peaks["True"], search.total)]
    if answer is not None and 0 < answer < search.total:
        rows.append((f"keep_unsharded={answer}", search.peak(answer), answer))
    rows += [("keep_unsharded=False", peaks["False"], 0),
             ('keep_unsharded=True, sync_grads="last"', peaks.get("True, last"), search.total)]
    gpu = human_bytes(gpu_memory)
    lines = [f"| option | peak per rank | all-gathers per step | fits in {gpu} |",
             "|---|--:|--:|---|"]
    for name, peak, budget in rows:
        shown = (human_bytes(peak) if peak is not None
                 else f"over {human_bytes(peaks['True'])} (not simulated)")
        fits = "yes" if peak is not None and peak <= gpu_memory else "no"
        lines.append(f"| {name} | {shown} | "
                     f"{all_gathers(units, budget, frees_after_forward=True)} | {fits} |")
    if "True, last" not in peaks:
        lines += ["", 'sync_grads="last" holds what keep_unsharded=True holds and the unsharded '
                  "gradients of every unit until the last pass: simulated only where "
                  "keep_unsharded=True fits."]
    return lines


def _node_option(budget: int, total: int, n: int, hybrid: bool) -> str:
    """The option's name as pasted (``hybrid``: on FSDP1 wrapped with ``HYBRID_SHARD``,
    where ``reshard_to=n`` changes nothing but refuses any other layout)."""
    keep = ("keep_unsharded=True" if budget >= total else "keep_unsharded=False" if budget == 0
            else f"keep_unsharded={budget}")
    return f"{keep}, reshard_to={n}" + (" with HYBRID_SHARD" if hybrid else "")


def _node_answer(found: FitRun, gpu_memory: int, world: int) -> list[str]:
    """``--node-size``: the option that fits with no inter-node re-gather between passes and
    the most all-gathers saved (the largest budget with ``reshard_to``; on FSDP1 with
    ``HYBRID_SHARD``), the plain budget beside it as the other trade-off."""
    assert found.node is not None
    node, units = found.node, found.meta["unit_bytes"]
    grouped, plain = node.search.answer(), found.search.answer()
    total, n = found.search.total, node.node_size
    if plain is not None and plain >= total:
        return _answer(found, gpu_memory)  # True fits: nothing is re-gathered at all
    false_option = _node_option(0, total, n, node.hybrid)
    if grouped is None:
        return [f"Nothing with reshard_to={n}{' and HYBRID_SHARD' * node.hybrid} fits: "
                f"keep_unsharded=False, {false_option.partition(', ')[2]} peaks at "
                f"{human_bytes(node.peaks['False'])} per rank, over {human_bytes(gpu_memory)}. "
                f"Without {'HYBRID_SHARD' if node.hybrid else 'reshard_to'}:", "",
                *_answer(found, gpu_memory)]
    option = _node_option(grouped, total, n, node.hybrid)
    peak = node.search.peak(grouped)
    assert peak is not None
    intra, inter, _ = gathers_by_node(units, grouped, True, node.hybrid)
    regather = all_gathers(units, 0, frees_after_forward=True)
    kept = node.search.kept(grouped)
    layers = f"{len(kept - {0})} of {len(units) - 1} decoder layers{' and the root' * (0 in kept)}"
    how = ("every one inside a node" if node.hybrid
           else "no inter-node all-gather between passes")
    others = ("" if grouped >= total
              else ", reshards the others to one node between passes" if not node.hybrid
              else ", re-gathers the others inside their node")
    lines = [
        f"Recommended with {n} ranks per node: {option}",
        f"  peak {human_bytes(peak)} per rank ({peak} bytes); keeps {layers} unsharded{others}: "
        f"{intra + inter} all-gathers per step ({intra} intra-node, {inter} inter-node), {how}; "
        f"saves {regather - intra - inter} all-gathers per step against {false_option}",
    ]
    if node.hybrid:
        shape = f"({world // n}, {n})"
        lines.append(f"  wrap FSDP1 with sharding_strategy=ShardingStrategy.HYBRID_SHARD and "
                     f"device_mesh=init_device_mesh(\"cuda\", {shape}) (shard groups of {n} "
                     "ranks, one node each; the peak is that model's)")
    paste = [f"Paste: no_reshard_between_backwards(model, {option.partition(' with ')[0]})"]
    if plain is not None:
        plain_peak = found.search.peak(plain)
        assert plain_peak is not None
        _, plain_inter, plain_bytes = gathers_by_node(units, plain, grouped=False)
        without = "FULL_SHARD" if node.hybrid else "without reshard_to"
        lines.append(
            f"The other trade-off, {without}: keep_unsharded={plain}: peak "
            f"{human_bytes(plain_peak)} per rank, {plain_inter} all-gathers per step, every one "
            f"inter-node ({human_bytes(plain_bytes)} of them between passes)")
        paste.append(f"   or: no_reshard_between_backwards(model, keep_unsharded={plain})"
                     + ("  # FULL_SHARD" if node.hybrid else ""))
    return [*lines, "", *paste]


def _node_table(found: FitRun, gpu_memory: int) -> list[str]:
    assert found.node is not None
    node, peaks, units = found.node, found.peaks, found.meta["unit_bytes"]
    n, total, hybrid = node.node_size, found.search.total, node.hybrid
    plain = " with FULL_SHARD" if hybrid else ""
    rows: list[tuple[str, int | None, int, bool]] = [
        (f"keep_unsharded=True (the default){plain}", peaks["True"], total, False)]
    if hybrid:
        rows.append((_node_option(total, total, n, True), node.peaks["True"], total, True))
    for search, grouped in ((node.search, True), (found.search, False)):
        answer = search.answer()
        if answer is not None and 0 < answer < total:
            name = (_node_option(answer, total, n, hybrid) if grouped
                    else f"keep_unsharded={answer}{plain}")
            rows.append((name, search.peak(answer), answer, grouped))
    rows += [(_node_option(0, total, n, hybrid), node.peaks["False"], 0, True),
             (f"keep_unsharded=False{plain}", peaks["False"], 0, False)]
    gpu = human_bytes(gpu_memory)
    lines = [f"| option | peak per rank | all-gathers per step (intra / inter-node) | "
             f"inter-node all-gather bytes between passes | fits in {gpu} |",
             "|---|--:|--:|--:|---|"]
    for name, peak, budget, grouped in rows:
        intra, inter, between = gathers_by_node(units, budget, grouped, hybrid and grouped)
        fits = "yes" if peak is not None and peak <= gpu_memory else "no"
        shown = human_bytes(peak) if peak is not None else "not simulated"
        lines.append(f"| {name} | {shown} | {intra + inter} ({intra} / {inter}) | "
                     f"{human_bytes(between) if between else '0'} | {fits} |")
    return lines
