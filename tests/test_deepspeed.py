"""DeepSpeed ZeRO-3 backend, CPU/gloo, world size 2, one launch.

Skipped when deepspeed is not installed (it is an optional extra:
``pip install fsdp-retain[deepspeed]``); CI runs it in its own venv.
"""

import pytest

pytest.importorskip("deepspeed", reason="deepspeed not installed (pip install fsdp-retain[deepspeed])")
pytest.importorskip("transformers", reason="the DeepSpeed cases use a tiny transformers Qwen2")

from tests import cases_deepspeed  # noqa: E402
from tests.harness import check_case, launch  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return launch("tests.cases_deepspeed", world_size=2, timeout=900)


@pytest.mark.parametrize("name", cases_deepspeed.registry.names(world_size=2))
def test_deepspeed(results, name):
    check_case(results, name)
