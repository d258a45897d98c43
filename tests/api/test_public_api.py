"""The public surface: what ``fsdp_retain`` exports, and the docstring example run as written.

The example in ``no_reshard_between_backwards.__doc__`` is cut out verbatim and launched
with ``torchrun`` on 2 CPU ranks (gloo); it prints ``block.backward_passes`` and the
number of times its activation hook fired (2 and 2 on each rank). Types are checked by mypy in CI
(``.ci/run``: the package and ``tests/api/typing_user.py``).
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from tests.support.harness import ROOT, run_retrying_exit_abort, timeout_scale


def test_exports():
    assert sorted(fsdp_retain.__all__) == [
        "LossGrads", "RetainBlock", "SyncGrads", "apply_grads", "combine", "gramian",
        "no_reshard_between_backwards",
    ]
    assert not hasattr(fsdp_retain, "RetainOptions")
    assert (ROOT / "fsdp_retain" / "py.typed").exists()


def docstring_example() -> str:
    doc = no_reshard_between_backwards.__doc__ or ""
    body = doc.split("Example::\n", 1)[1]
    return textwrap.dedent(body)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_docstring_example_runs_as_written(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(docstring_example())
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = run_retrying_exit_abort(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script)],
        cwd=tmp_path, env=env, timeout=300 * timeout_scale(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):  # the ranks print concurrently: lines may interleave
        assert f"rank {rank}: 2 passes, 2 hook calls" in proc.stdout, proc.stdout
