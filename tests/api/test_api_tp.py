"""API surface beside the block, on real parallel stacks (CPU/gloo).

``tests/api/cases_api_tp.py``: FSDP2 x tensor parallelism on a 2-D (dp, tp) mesh,
every option (``keep_unsharded`` True/False/byte budget, ``sync_grads``
every/last, ``backwards`` None/int), probe passes and ``loss_parallel``, each
in parity with an unsharded reference; HSDP x TP on a 3-D mesh (8 ranks).

``tests/api/cases_api_fsdp2_reshard.py`` (2 ranks): the user's own FSDP2 reshard
flags (``set_reshard_after_backward(False)`` for gradient accumulation,
``reshard_after_forward=False``): all-gather counts, parity and the group state
after the block.
"""

from tests.support.harness import case_tests

case_tests(globals(), "tests.api.cases_api_tp", {
    "test_api_tp": (4, 600),
    "test_api_hsdp_tp": (8, 600),
})

case_tests(globals(), "tests.api.cases_api_fsdp2_reshard", {
    "test_api_fsdp2_reshard": (2, 600),
})
