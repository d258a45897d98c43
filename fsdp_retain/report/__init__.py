"""Memory, time and communication of fsdp_retain against a second forward.

``python -m fsdp_retain.report`` (or ``scripts/memory_report.py``; see
``docs/report/README.md``). One causal LM with random weights, wrapped per
decoder layer plus root, runs one training step with two losses from one
forward (a token log-prob loss, then a policy-gradient loss with random
advantages) in each mode of ``MODES``: ``two_forward`` (what users do without
the library), ``naive`` (``retain_graph=True`` without it), ``keep`` and
``regather`` (the library with ``keep_unsharded=True`` / ``False``).

Per mode and rank it measures, in separate steps: the median step time of
interleaved, uninstrumented steps; the collectives of one step; the peak
memory of one step and its breakdown at the peak from torch's memory
trackers. ``--simulate-world-size N`` estimates memory only, for N ranks, in
one process with a fake process group and fake tensors.

The core library never imports this package. One concern per module:
``_modes`` (what each mode runs and promises, the bounds), ``_config``
(``ReportConfig``, presets), ``_cli``, ``_hf_config`` (reading a
``config.json``), ``_model`` (build and wrap), ``_step`` (the training step),
``_hooks`` (what a measurement wraps around a step), ``_deps`` (what it needs
beyond torch, checked up front), ``_memory`` (peak and breakdown), ``_runner``
(one backend on one rank), ``_run_measures`` (one counted or memory-tracked step),
``_rows`` (``ReportRow``: the schema of a row),
``_results`` (rows from every rank, the comparisons, the report), ``_simulate``,
``_launch`` (ranks), ``_deepspeed`` and ``_ddp`` (the ZeRO-3 and DDP backends; ``_ddp``
also checks that a step leaves the same gradients on every rank), ``_output`` (the files), ``_figures`` (the figures;
``python -m fsdp_retain.report.figures`` redraws them from ``report.json`` files).
``python -m fsdp_retain.report fit`` prints the largest ``keep_unsharded`` budget that
fits a GPU: ``_fit_cli`` (its command line and answer), ``_fit_search`` (which budgets to
simulate), ``_fit_sims`` (the simulated steps, forked from one build), ``_fit`` (budgets'
units and all-gathers). ``python -m fsdp_retain.report calibrate``: this machine's speed on
a fixed CPU workload (``_calibrate``), to quote beside CPU times.
"""

from ._cli import main, parse_args
from ._config import SIZES, ReportConfig
from ._launch import run_report
from ._modes import DEFAULT_MODES, MODES, Mode, ModeSpec

__all__ = [
    "DEFAULT_MODES",
    "MODES",
    "SIZES",
    "Mode",
    "ModeSpec",
    "ReportConfig",
    "main",
    "parse_args",
    "run_report",
]
