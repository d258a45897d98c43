"""The memory report (scripts/memory_report.py) on a tiny Qwen2, CPU/gloo, world size 2.

One launch runs both backends (fsdp2, fsdp1) and the seven default modes (two_forward,
naive, keep:every, keep:last, probe:every, check:every, regather:every) with 1 warm-up and
3 timed steps (``run_report``, in a process started when the tests are collected:
tests/report/report_runs.py); the tests read the returned report and the files it wrote.
A second run of the script (a subprocess) simulates the same 2 ranks with a
fake process group and is compared with the real run; a third simulates the
same model from a config.json (--model-config) and is compared with the second.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from fsdp_retain.report import DEFAULT_MODES, Mode, ReportConfig, run_report
from fsdp_retain.report._modes import KEEP_SLACK, REGATHER_SLACK
from fsdp_retain.report._rows import BREAKDOWN_KEYS, Report, ReportRow
from tests.report.report_runs import returned_report, start_report, taken
from tests.support import background

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("fsdp2", "fsdp1")
ROW_TYPES = typing.get_type_hints(ReportRow)  # the schema: field -> its type
# The row fields of --node-size and regather_node (reports before them lack these).
NODE_SIZE_KEYS = {"reshard_to", "all_gather_bytes_by_group", "all_gather_bytes_between_passes",
                  "inter_node_all_gather_bytes_between_passes"}


def conforms(value, hint) -> bool:
    """``value`` (as JSON holds it) has type ``hint`` (``int | None``, ``list[int]``, ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:
        return any(conforms(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    return isinstance(value, (int, float) if hint is float else hint)


@background.starts_early("report_run")
def _start_report() -> background.BackgroundRun:
    return start_report("report_", backends=BACKENDS, size="tiny", warmup=1, steps=3,
                        timeout=600, command="tests/report/test_report.py")


@pytest.fixture(scope="module")
def report(report_run):
    """(what run_report returned, its folder)."""
    proc, out = report_run
    return returned_report(proc), out


@pytest.fixture(scope="module")
def report_run():
    with taken("report_run") as run:
        yield run


def rows_of(report, backend=None, mode=None):
    return [
        r for r in report["rows"]
        if (backend is None or r["backend"] == backend) and (mode is None or r["mode"] == mode)
    ]


def row(report, backend, label):
    (found,) = [r for r in report["rows"] if r["backend"] == backend and r["label"] == label]
    return found


def fsdp1_backend_present() -> bool:
    return importlib.util.find_spec("fsdp_retain._fsdp1") is not None


def test_every_row_present(report):
    rep, _ = report
    got = [(r["backend"], r["label"]) for r in rep["rows"]]
    assert sorted(got) == sorted(itertools.product(BACKENDS, DEFAULT_MODES))


def test_json_schema_and_file(report):
    rep, out = report
    assert json.loads((out / "report.json").read_text()) == rep
    assert set(rep) == {"config", "rows"}
    cfg = rep["config"]
    for key in ("command", "device", "world_size", "dtype", "layers", "hidden", "seq_len",
                "batch_per_rank", "param_count", "unsharded_param_bytes", "timed_steps", "torch"):
        assert key in cfg, key
    assert cfg["world_size"] == 2 and cfg["device"] == "cpu" and cfg["timed_steps"] == 3
    for r in rep["rows"]:
        # The schema's keys in its order (probe and check rows add theirs), of its types.
        assert list(r) == ReportRow.json_keys(r["mode"]), r["label"]
        for key, value in r.items():
            assert conforms(value, ROW_TYPES[key]), (r["label"], key, value, ROW_TYPES[key])
        assert ReportRow.from_json(r).to_json() == r and isinstance(r["fsdp_units"], int), r
        assert r["ok"] == (r["error"] is None), r
        assert r["sync_grads"] == Mode.parse(r["label"]).sync_grads
        if r["ok"]:
            assert set(r["breakdown"]) == set(BREAKDOWN_KEYS)
            assert len(r["peak_bytes_per_rank"]) == 2
            assert r["peak_bytes"] == max(r["peak_bytes_per_rank"]) > 0
            # The breakdown partitions the tracker's peak (CPU: that is the peak).
            assert sum(r["breakdown"].values()) == r["tracker_peak_bytes"] == r["peak_bytes"]


def test_fsdp2_rows_ok_and_fsdp1_baseline_ok(report):
    rep, _ = report
    for r in rows_of(rep, "fsdp2"):
        assert r["ok"], r["error"]
    assert row(rep, "fsdp1", "two_forward")["ok"]


def test_fsdp1_naive_records_the_crash(report):
    """Plain FSDP1 frees the storage a retained graph needs: the row records the error."""
    r = row(report[0], "fsdp1", "naive")
    assert not r["ok"]
    assert "RuntimeError" in r["error"] and "storage" in r["error"], r["error"]
    assert r["peak_bytes"] is None and r["step_time_s"] is None
    # Labelled as the crash the library removes, so it does not fail the run.
    assert "plain FSDP1" in r["expected_error"], r
    assert "the expected crash: plain FSDP1" in (report[1] / "report.md").read_text()
    assert all(x["expected_error"] is None for x in report[0]["rows"] if x is not r)


def test_fsdp1_library_rows_ok_or_clear_error(report):
    for r in rows_of(report[0], "fsdp1"):
        if r["mode"] not in ("keep", "probe", "check", "regather"):
            continue
        if fsdp1_backend_present():
            assert r["ok"], r["error"]
        else:
            assert not r["ok"] and "_fsdp1" in r["error"], r["error"]


def test_backward_all_gathers_prefetched(report):
    """``regather`` re-gathers every unit in each pass, each all-gather issued while the
    unit before runs its backward, as plain FSDP does in its one backward
    (``two_forward``); ``keep`` re-gathers nothing."""
    rep, _ = report
    for backend, label in itertools.product(BACKENDS, ("two_forward", "regather:every")):
        r = row(rep, backend, label)
        if not r["ok"]:
            continue  # test_fsdp1_library_rows_ok_or_clear_error says why
        done, could = r["prefetched_all_gathers"]
        # Units after the first in backward order, in both passes.
        assert could == 2 * (r["fsdp_units"] - 1) and done == could, (backend, label, done, could)
    for backend in BACKENDS:
        r = row(rep, backend, "keep:every")
        if r["ok"]:
            assert r["prefetched_all_gathers"] == [0, 0], r["prefetched_all_gathers"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_counts_from_a_timeline(prefetch):
    """Root and three layers; the root and the last layer kept, the others re-gathered."""
    from fsdp_retain.report._prefetch import prefetch_counts

    root, layer = 100, 10
    forward = [("ag", root)] + [("ag", layer)] * 3
    regather = (
        [("ag", root), ("ag", layer), ("mark", 0), ("ag", layer), ("mark", 1),
         ("ag", layer), ("mark", 2), ("mark", 3)]
        if prefetch else
        [("ag", root), ("mark", 0), ("ag", layer), ("mark", 1), ("ag", layer), ("mark", 2),
         ("ag", layer), ("mark", 3)]
    )
    budget = (
        [("mark", 0), ("ag", layer), ("mark", 1), ("ag", layer), ("mark", 2), ("mark", 3)]
        if prefetch else
        [("mark", 0), ("mark", 1), ("ag", layer), ("mark", 2), ("ag", layer), ("mark", 3)]
    )
    second_forward = [("gap", None), ("ag", root), ("ag", layer), ("pass", None)]
    events = forward + [("pass", None)] + regather + second_forward + budget
    assert prefetch_counts(events, 4) == ((5, 5) if prefetch else (0, 5))


def expected_collectives(mode: Mode, units: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) per step; the layers reshard after forward, the root not.

    Forward: one all-gather per unit. A backward re-gathers every layer that is
    sharded when it starts (all but the root after a forward; every unit after a
    backward that resharded). ``keep``: one all-gather per unit per step. One
    reduce-scatter per unit per backward, or per step with sync_grads="last".
    """
    layers = units - 1
    if mode.name == "two_forward":
        return 2 * (units + layers), 2 * units
    if mode.name in ("keep", "check"):
        return units, units * (1 if mode.sync_grads == "last" else 2)
    if mode.name == "probe":  # backward 1 reduces nothing
        return units, units
    # naive (FSDP2 re-gathers by itself) and regather
    return units + layers + units, units * (1 if mode.sync_grads == "last" else 2)


def test_collectives_per_step(report):
    rep, _ = report
    cfg = rep["config"]
    unsharded = cfg["unsharded_param_bytes"]
    for r in rep["rows"]:
        assert r["fsdp_units"] == cfg["layers"] + 1, r
        if not r["ok"]:
            continue
        ag, rs = expected_collectives(Mode.parse(r["label"]), r["fsdp_units"])
        where = f"{r['backend']} {r['label']}"
        assert r["all_gathers_per_step"] == ag, where
        assert r["reduce_scatters_per_step"] == rs, where
        if r["mode"] == "keep":
            # One all-gather per unit: every unsharded byte moves once (padding aside).
            assert unsharded <= r["all_gather_bytes_per_step"] <= 1.01 * unsharded + 4096, where


def test_keep_rows_one_all_gather_per_unit(report):
    keep_rows = [r for r in rows_of(report[0], mode="keep") if r["ok"]]
    assert {r["backend"] for r in keep_rows} >= {"fsdp2"}
    for r in keep_rows:
        assert r["all_gathers_per_step"] == r["fsdp_units"], r


def test_memory_bounds(report):
    """Overhead against two_forward: keep <= (unsharded params of all units, + their grads with
    sync_grads="last") * (1 + KEEP_SLACK); regather <= REGATHER_SLACK * two_forward's peak."""
    rep, _ = report
    unsharded = rep["config"]["unsharded_param_bytes"]
    for backend in BACKENDS:
        base = row(rep, backend, "two_forward")
        for r in rows_of(rep, backend):
            if not r["ok"] or r["mode"] not in ("keep", "probe", "check", "regather"):
                continue
            where = f"{backend} {r['label']}"
            overhead = r["peak_bytes"] - base["peak_bytes"]
            assert r["memory_overhead_bytes"] == overhead, where
            if r["mode"] in ("keep", "probe", "check"):
                budget = (1 + KEEP_SLACK) * unsharded * (2 if r["sync_grads"] == "last" else 1)
                # keep really keeps: every unit's unsharded params are alive at the peak.
                assert r["breakdown"]["unsharded_params"] >= 0.99 * unsharded, where
            else:
                budget = REGATHER_SLACK * base["peak_bytes"]
            assert overhead <= budget, f"{where}: overhead {overhead} > budget {budget:.0f}"
            assert r["within_bound"] is True and r["memory_bound_bytes"] <= budget + 1, where


def test_times_and_savings_fields(report):
    rep, _ = report
    for r in rep["rows"]:
        if not r["ok"]:
            continue
        assert r["timed_steps"] == 3 and r["step_time_s"] > 0, r
        assert r["time_ratio"] == pytest.approx(
            r["step_time_s"] / row(rep, r["backend"], "two_forward")["step_time_s"])
    for backend in BACKENDS:
        base = row(rep, backend, "two_forward")
        assert 0 < base["forward2_time_s"] < base["step_time_s"]
        keep = row(rep, backend, "keep:every")
        if keep["ok"]:
            assert keep["ideal_saving_s"] == base["forward2_time_s"]
            assert keep["share_of_ideal_saving"] == pytest.approx(
                keep["saved_time_s"] / keep["ideal_saving_s"])


def test_files_written(report):
    rep, out = report
    md = (out / "report.md").read_text()
    for r in rep["rows"]:
        assert f"`{r['label']}`" in md
    assert "| backend | mode |" in md and "## Errors" in md and "setStorage" in md
    # The legend says which options each mode name stands for.
    assert "## Modes" in md
    assert ('| `keep:last` | no_reshard_between_backwards(model, keep_unsharded=True, '
            'sync_grads="last", backwards=2) |') in md
    assert "backward 1 is a probe pass" in md and "check_saved_tensors=True" in md
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def simulate(tmp_path, *args: str, script: str = "scripts/memory_report.py"):
    """Runs the report as a subprocess with ``--simulate-world-size 2``; (report, stdout)."""
    proc = subprocess.run(
        [sys.executable, *script.split(), "--simulate-world-size", "2", *args,
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "report.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """The script simulates the tiny model on 2 ranks with a fake process group, FSDP2."""
    return simulate(tmp_path_factory.mktemp("sim"), "--size", "tiny", "--backend", "fsdp2")


def test_simulated_world_matches_real_run(report, simulated):
    """The script, as a subprocess, simulates the same 2 ranks with a fake process group."""
    real, _ = report
    sim, stdout = simulated
    assert sim["config"]["simulated"] and sim["config"]["world_size"] == 2
    for r in sim["rows"]:
        assert r["ok"] and r["simulated"] and r["step_time_s"] is None, r
        measured = row(real, "fsdp2", r["label"])
        assert r["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.10), r["label"]
        assert r["breakdown"]["sharded_params"] == measured["breakdown"]["sharded_params"]
        if r["mode"] in ("keep", "regather"):
            assert r["within_bound"] is True, r
        # Progress: one line per backend and mode; the table: one row per mode.
        assert f"fsdp2 {r['label']}: peak " in stdout, stdout
        assert f"| `{r['label']}` | " in stdout, stdout


def write_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path / "config.json"


# The "tiny" preset (tests/report/test_report.py's model) as a Hugging Face config.json.
TINY_QWEN2 = dict(model_type="qwen2", num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                  tie_word_embeddings=False, max_position_embeddings=32768)


def test_model_config_json_simulates_like_the_preset(simulated, tmp_path):
    """--model-config with a config.json written here (the tiny preset's shape), both
    backends (one process each), through python -m fsdp_retain.report: FSDP2 peaks and
    breakdowns equal the preset's byte for byte."""
    path = write_config(tmp_path / "qwen", **TINY_QWEN2)
    sim, stdout = simulate(tmp_path / "out", "--model-config", str(path), "--seq-len", "64",
                           "--batch", "2", "--modes", "two_forward", "keep:every",
                           script="-m fsdp_retain.report")
    cfg = sim["config"]
    assert cfg["model_config"] == str(path) and cfg["size"] is None
    assert cfg["model"] == "Qwen2ForCausalLM (random weights)"
    assert (cfg["layers"], cfg["hidden"], cfg["vocab"], cfg["seq_len"]) == (3, 64, 2048, 64)
    assert cfg["command"].startswith("python -m fsdp_retain.report --simulate-world-size 2 ")
    preset, _ = simulated
    assert cfg["param_count"] == preset["config"]["param_count"]
    assert [(r["backend"], r["label"]) for r in sim["rows"]] == [
        (b, m) for b in BACKENDS for m in ("two_forward", "keep:every")]
    for r in sim["rows"]:
        assert r["ok"], r
        if r["backend"] == "fsdp2":
            same = row(preset, "fsdp2", r["label"])
            assert (r["peak_bytes"], r["breakdown"]) == (same["peak_bytes"], same["breakdown"])
        if r["mode"] == "keep":
            assert r["within_bound"] is True, r
    assert "| mode | fsdp2 | fsdp1 |" in stdout, stdout


def test_model_config_llama_and_flags(tmp_path):
    """A Llama config.json (a folder works too); the dimension flags override its fields."""
    from fsdp_retain.report._model import check_model_config, hf_config

    llama = dict(TINY_QWEN2, model_type="llama", max_position_embeddings=512)
    folder = write_config(tmp_path / "llama", **llama).parent
    cfg = ReportConfig(model_config=str(folder), layers=2, hidden=128)
    dims = cfg.dims()
    assert (dims["layers"], dims["hidden"], dims["intermediate"], dims["kv_heads"]) == (
        2, 128, 128, 2)
    assert (dims["seq_len"], dims["batch"]) == (512, 1)
    config = hf_config(cfg)
    assert type(config).__name__ == "LlamaConfig"
    assert (config.num_hidden_layers, config.hidden_size, config.use_cache) == (2, 128, False)
    check_model_config(cfg)


@pytest.mark.parametrize(
    "fields, message",
    [
        (None, "no such file"),
        ("{not json", "cannot read it"),
        (dict(model_type="t5", d_model=64), "AutoModelForCausalLM"),
        (dict(TINY_QWEN2, hidden_size=65), "hidden"),
    ],
)
def test_model_config_errors_name_the_fix(tmp_path, fields, message):
    path = tmp_path / "config.json"
    if isinstance(fields, str):
        path.write_text(fields)
    elif fields is not None:
        write_config(tmp_path, **fields)
    with pytest.raises(ValueError, match=message):
        ReportConfig(model_config=str(path))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(modes=("keep:every",)), "two_forward"),
        (dict(modes=("two_forward", "keep:sometimes")), "keep:sometimes"),
        (dict(backends=("megatron",)), "megatron"),
        (dict(hidden=65), "hidden"),
    ],
)
def test_config_errors_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReportConfig(size="tiny", **kwargs)


def test_probe_row_times_backward_one_against_the_full_backward(report):
    """The probe row's backward 1 is compared with keep's (same run, same sync_grads) and
    projected onto the H200 profile; the ratio itself is a benchmark figure, not asserted."""
    from fsdp_retain.report._results import H200_PHASES, projected_step_ratio

    rep, out = report
    for backend in BACKENDS:
        probe, keep = row(rep, backend, "probe:every"), row(rep, backend, "keep:every")
        if not (probe["ok"] and keep["ok"]):
            continue
        assert probe["backward1_time_s"] > 0 and keep["backward1_time_s"] > 0
        ratio = probe["backward1_time_s"] / keep["backward1_time_s"]
        assert probe["probe_backward_ratio"] == pytest.approx(ratio)
        p = H200_PHASES
        assert probe["projected_h200_step_ratio"] == pytest.approx(
            (p["forward1"] + ratio * p["backward1"] + p["backward2"])
            / (p["forward1"] + p["backward1"] + p["forward2"] + p["backward2"]))
    # Removing the second forward alone, the figure the probe pass is compared with.
    assert projected_step_ratio(1.0) == pytest.approx(0.8147, abs=1e-4)
    assert "## Probe pass" in (out / "report.md").read_text()


def test_check_row_cost_against_keep(report):
    """check:every is keep:every plus check_saved_tensors=True: its step-time ratio to keep
    (same run) is reported; the check finds nothing on the report's model."""
    rep, out = report
    for backend in BACKENDS:
        check, keep = row(rep, backend, "check:every"), row(rep, backend, "keep:every")
        if backend == "fsdp2" or fsdp1_backend_present():
            assert check["ok"], check["error"]
        if check["ok"] and keep["ok"]:
            assert check["check_cost_ratio"] == pytest.approx(
                check["step_time_s"] / keep["step_time_s"])
    assert "check_saved_tensors=True" in (out / "report.md").read_text()


def _report_with(*rows: dict) -> dict:
    return {"config": {}, "rows": list(rows)}


def _row(label: str, backend: str, error: str | None, expected: str | None = None) -> dict:
    mode = Mode.parse(label)
    return ReportRow(mode=mode.name, label=label, backend=backend, sync_grads=mode.sync_grads,
                     ok=error is None, error=error, expected_error=expected, world_size=2,
                     simulated=False).to_json()


@pytest.mark.parametrize(
    "rows, code",
    [
        ([_row("two_forward", "fsdp2", None), _row("keep:every", "fsdp2", None)], 0),
        ([_row("naive", "fsdp1", "warm-up: RuntimeError: setStorage", "plain FSDP1 ...")], 0),
        ([_row("two_forward", "fsdp2", None), _row("keep:every", "fsdp2", "timing: OOM")], 1),
        ([_row("naive", "fsdp1", "setup: ModuleNotFoundError: x")], 1),
    ],
    ids=["all_rows", "only_the_expected_crash", "a_failed_row", "setup_failed"],
)
def test_exit_code_nonzero_when_a_row_failed(monkeypatch, capsys, tmp_path, rows, code):
    """``python -m fsdp_retain.report`` exits 1 when a requested row could not be produced
    (an expected crash, such as plain FSDP1's naive row, is a produced row)."""
    from fsdp_retain.report import _cli

    monkeypatch.setattr(_cli, "run_report", lambda cfg: _report_with(*rows))
    assert _cli.main(["--size", "tiny", "--out", str(tmp_path)]) == code
    if code:
        assert "could not be produced" in capsys.readouterr().err


def test_missing_transformers_fails_up_front_naming_the_extra(tmp_path):
    """With transformers missing, the CLI stops before running anything, names the
    report extra and exits 2 (before: every row failed in setup and the exit code was 0)."""
    code = ("import sys; sys.modules['transformers'] = None; "
            "from fsdp_retain.report._cli import main; "
            f"sys.exit(main(['--simulate-world-size', '8', '--size', 'tiny', '--out', {str(tmp_path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs transformers" in proc.stderr, proc.stderr
    assert "from a clone of this repository: pip install '.[report]'" in proc.stderr
    assert "setup FAILED" not in proc.stdout and not (tmp_path / "report.json").exists()


def test_missing_deepspeed_names_its_extra(monkeypatch, capsys, tmp_path):
    from fsdp_retain.report import _cli
    from fsdp_retain.report._deps import MissingDependency, check_dependencies

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert _cli.main(["--backend", "deepspeed", "--size", "tiny", "--out", str(tmp_path)]) == 2
    assert "DS_BUILD_OPS=0 pip install '.[deepspeed]'" in capsys.readouterr().err
    with pytest.raises(MissingDependency, match="deepspeed"):
        run_report(ReportConfig(backends=("deepspeed",), size="tiny", out=str(tmp_path)))
    check_dependencies(("fsdp2", "fsdp1"))  # torch-only backends need nothing more


@pytest.mark.parametrize("path", sorted((ROOT / "docs/report").rglob("report.json")),
                         ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_committed_reports_read(path):
    """Every committed report.json reads as a ``Report``; written again, its rows keep their
    keys, order and values (older reports gain ``expected_error``,
    ``prefetched_all_gathers`` and the ``--node-size`` fields, ``NODE_SIZE_KEYS``), and
    docs/report/report.json comes out byte for byte."""
    data = json.loads(path.read_text())
    written = Report.from_json(data).to_json()
    assert written["config"] == data["config"]
    for old, new in zip(data["rows"], written["rows"], strict=True):
        assert [(k, v) for k, v in new.items() if k in old] == list(old.items())
        assert set(new) - set(old) <= {"expected_error", "prefetched_all_gathers",
                                       *NODE_SIZE_KEYS}
        assert all(conforms(v, ROW_TYPES[k]) for k, v in old.items()), old
    if path == ROOT / "docs/report/report.json":
        assert json.dumps(written, indent=2) + "\n" == path.read_text()
