"""The ``summary`` stage of ``scripts/gpu_validate.py``: ``summary.md`` and ``summary.json``
from the files the other stages wrote (any of them may be missing: the summary says so)."""

from __future__ import annotations

import json
from pathlib import Path

# report/<folder>/: the report stage's backends, then the stacks and compile stages' runs.
BACKENDS = ("fsdp2", "fsdp1", "ddp", "deepspeed", "fsdp2-compile")
HEADLINE = ("backend", "mode", "step (ms)", "vs two_forward", "peak ({unit})",
            "peak vs two_forward", "all-gathers / step", "reduce-scatters / step",
            "all-reduces / step")


def _read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def headline_rows(reports: dict[str, dict]) -> list[dict]:
    """One entry per backend and mode: what the README quotes."""
    rows = []
    for backend, report in reports.items():
        for r in report["rows"]:
            rows.append(dict(
                backend=backend, mode=r["label"], ok=r["ok"], error=r["error"],
                step_ms=None if r["step_time_s"] is None else r["step_time_s"] * 1e3,
                time_ratio=r.get("time_ratio"),
                peak_bytes=r["peak_bytes"], overhead_bytes=r.get("memory_overhead_bytes"),
                within_bound=r.get("within_bound"),
                all_gathers=r["all_gathers_per_step"],
                reduce_scatters=r["reduce_scatters_per_step"],
                all_reduces=r["all_reduces_per_step"],
                share_of_ideal_saving=r.get("share_of_ideal_saving"),
                one_pass_ratio=r.get("one_pass_ratio"),
            ))
    return rows


def _headline_md(rows: list[dict]) -> list[str]:
    peaks = [r["peak_bytes"] for r in rows if r["peak_bytes"]]
    unit, size = ("GiB", 2**30) if max(peaks, default=0) >= 2**30 else ("MiB", 2**20)
    header = [h.format(unit=unit) for h in HEADLINE]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "--:|" * (len(header) - 2)]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['backend']} | `{r['mode']}` | error: {r['error'][:120]} |"
                         + " |" * (len(header) - 3))
            continue
        peak = None if r["peak_bytes"] is None else r["peak_bytes"] / size
        over = None if r["overhead_bytes"] is None else r["overhead_bytes"] / size
        cells = [r["backend"], f"`{r['mode']}`", _fmt(r["step_ms"], ".1f"),
                 _fmt(r["time_ratio"], ".2f", "x"), _fmt(peak, ".2f"), _fmt(over, "+.2f"),
                 _fmt(r["all_gathers"], "d"), _fmt(r["reduce_scatters"], "d"),
                 _fmt(r["all_reduces"], "d")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _setup_line(reports: dict[str, dict], attempts: dict[str, list]) -> str:
    cfg = next(iter(reports.values()))["config"]
    tried = {b: [a["batch"] for a in a_list] for b, a_list in attempts.items() if a_list}
    fallback = "; ".join(f"{b}: batch {' -> '.join(map(str, t))} (out of memory before the last)"
                         for b, t in tried.items() if len(t) > 1)
    batches = sorted({r["config"]["batch_per_rank"] for r in reports.values()})
    return (f"{cfg['model']}, {cfg['layers']} layers, hidden {cfg['hidden']}, "
            f"{cfg['param_count'] / 1e6:.1f}M parameters, {cfg['dtype']}, batch "
            f"{'/'.join(map(str, batches))} x {cfg['seq_len']} tokens per rank, "
            f"{cfg['world_size']} rank(s) on {cfg['device_name']} ({cfg['process_group']}), "
            f"{cfg['warmup_steps']} warm-up + {cfg['timed_steps']} timed steps per mode "
            f"(median; a step ends when its slowest rank does); peak memory from "
            f"{'torch.cuda.max_memory_allocated' if cfg['device'] == 'cuda' else 'torch memory trackers'}."
            + (f" Fallback: {fallback}." if fallback else ""))


def _parity_md(parity: dict | None, module: str = "tests/repo/cases_device.py") -> list[str]:
    if parity is None:
        return ["Not run."]
    skipped = f", {parity['skipped']} skipped" if parity.get("skipped") else ""
    where = parity.get("device", f"{parity['process_group']}")
    lines = [f"`{module}` on {parity['world_size']} {where} rank(s) "
             f"({parity['process_group']}): **{parity['passed']} passed, {parity['failed']} "
             f"failed**{skipped} in {parity['seconds']} s."]
    for name, case in parity["cases"].items():
        if case.get("skipped"):
            lines.append(f"- skipped `{name}`: {case['skipped']}")
        elif not case["ok"]:
            last = (case["error"] or "").strip().splitlines()[-1:] or [""]
            lines.append(f"- FAILED `{name}`: {last[0][:300]}")
    return lines


def _one_pass_md(rows: list[dict]) -> list[str]:
    ones = [r for r in rows if r.get("one_pass_ratio") is not None]
    if not ones:
        return ["Not run."]
    return ["One backward of the two losses' sum in the block (`one_pass:every`) against the "
            "same step without the library (`one_backward`), same run: "
            + ", ".join(f"{r['backend']} {r['one_pass_ratio']:.3f}x" for r in ones) + "."]


def _bench_md(folder: Path) -> list[str]:
    lines = []
    probe = _read(folder / "bench" / "bench_probe.json")
    if probe:
        lines += [f"Probe pass (`scripts/bench_probe.py`, batch {probe['dims']['batch']} x "
                  f"{probe['dims']['seq_len']}, {probe['dtype']}, {probe['world']} rank(s); "
                  f"median of {probe['steps']} after {probe['warmup']} warm-up):", "",
                  "| backward 1 | " + " | ".join(probe["results"]) + " |",
                  "|---|" + "--:|" * len(probe["results"])]
        res = probe["results"].values()
        for way in ("full_every", "full_last", "probe"):
            lines.append(f"| {way} (ms) | "
                         + " | ".join(f"{r['median_s'][way] * 1e3:.1f}" for r in res) + " |")
        lines.append("| probe / full_last | "
                     + " | ".join(f"{r['ratios']['probe_vs_full_last']:.2f}x" for r in res) + " |")
        lines.append("| probe / full_every | "
                     + " | ".join(f"{r['ratios']['probe_vs_full_every']:.2f}x" for r in res) + " |")
        lines.append("")
    checks = [c for v in (2, 1) if (c := _read(folder / "bench" / f"saved_tensor_check_fsdp{v}.json"))]
    if checks:
        lines += ["`check_saved_tensors=True` (`scripts/bench_saved_tensor_check.py`):", "",
                  "| backend | batch | step without (ms) | with (ms) | ratio | saved tensors "
                  "per forward | max param difference |", "|---|--:|--:|--:|--:|--:|--:|"]
        for c in checks:
            lines.append(f"| fsdp{c['fsdp']} | {c['batch']} x {c['seq_len']} | "
                         f"{c['median_ms_without']:.1f} | {c['median_ms_with']:.1f} | "
                         f"{c['ratio']:.2f}x | {c['saved_tensors_per_forward']} "
                         f"({c['saved_mib_per_forward']} MiB) | {c['max_param_difference']:.3g} |")
    return lines or ["Not run."]


def _env_md(env: dict | None) -> list[str]:
    if env is None:
        return ["Not recorded."]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in env["gpus"]) or "none"
    pkgs = ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
    lines = [f"- device: {gpus}; driver {env['driver']}; CUDA runtime {env['cuda_runtime']}; "
             f"NCCL {env['nccl']}",
             f"- torch {env['torch']} (supported: torch{env['torch_supported']}); python "
             f"{env['python']}; {pkgs}",
             f"- {env['platform']}, {env['cpu_count']} CPUs"]
    lines += [f"- PROBLEM: {p}" for p in env["problems"]]
    return lines


def write_summary(folder: Path, *, dry_run: bool) -> Path:
    """Writes summary.md and summary.json into ``folder``; returns the Markdown path."""
    env = _read(folder / "env.json")
    parity = _read(folder / "parity.json")
    reports = {b: r for b in BACKENDS if (r := _read(folder / "report" / b / "report.json"))}
    attempts = {b: _read(folder / "report" / b / "attempts.json") or [] for b in BACKENDS}
    commands = []
    if (folder / "commands.jsonl").exists():
        commands = [json.loads(line) for line in (folder / "commands.jsonl").read_text().splitlines()]
    rows = headline_rows(reports)
    where = ("DRY RUN on CPU/gloo with a tiny model: these figures check the kit, they are not "
             "GPU results." if dry_run else
             "Measured on GPU (NCCL) by `bash scripts/gpu_validate.sh`.")
    gpu = ", ".join(g["name"] for g in (env or {}).get("gpus", [])) or "CPU"
    md = [f"# fsdp_retain validation: {gpu}, torch {(env or {}).get('torch', '?')}", "", where, ""]
    md += ["## Headline", ""]
    if reports:
        md += [_setup_line(reports, attempts), ""] + _headline_md(rows)
        md += ["", "`vs two_forward`: step time against the two-forward step of the same "
               "backend (below 1 is faster); `peak vs two_forward`: the extra peak memory. "
               "Every figure per backend is in `report/<backend>/report.md` and `report.json`."]
    else:
        md.append("The report stage has not run.")
    md += ["", "## One pass in the block", ""] + _one_pass_md(rows)
    md += ["", "## Parity (tests/repo/cases_device.py)", ""] + _parity_md(parity)
    stacks = _read(folder / "stacks.json")
    stacks_parity = _read(folder / "stacks_parity.json")
    compile_parity = _read(folder / "compile_parity.json")
    md += ["", "## DDP and DeepSpeed (stage stacks)", ""]
    if stacks is not None:
        md += [f"DeepSpeed: {stacks['deepspeed']}.", ""]
    md += _parity_md(stacks_parity, "tests/repo/cases_device_stacks.py")
    md += ["", "## FSDP2 with compiled decoder layers (stage compile)", ""]
    md += _parity_md(compile_parity, "tests/repo/cases_device_compile.py")
    md += ["", "## Benchmarks", ""] + _bench_md(folder)
    md += ["", "## Machine and versions", ""] + _env_md(env)
    md += ["", "## Commands", "", "What each stage ran, from the repository root "
           "(`logs/` has their output):", "", "```bash"]
    md += [f"# {c['stage']}\n{c['command']}" for c in commands] + ["```", ""]
    (folder / "summary.md").write_text("\n".join(md))
    counts = lambda p: None if p is None else {k: p.get(k, 0) for k in ("passed", "failed", "skipped")}  # noqa: E731
    summary = dict(dry_run=dry_run, env=env, headline=rows,
                   parity=None if parity is None else {k: parity[k] for k in ("passed", "failed")},
                   stacks_parity=counts(stacks_parity), compile_parity=counts(compile_parity),
                   deepspeed=None if stacks is None else stacks["deepspeed"],
                   one_pass={r["backend"]: r["one_pass_ratio"] for r in rows
                             if r.get("one_pass_ratio") is not None},
                   commands=[c["command"] for c in commands])
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return folder / "summary.md"
