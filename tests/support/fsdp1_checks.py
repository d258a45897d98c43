"""What the FSDP1 case modules check after a step (``tests/fsdp1/cases_fsdp1*.py``): the
collectives a step issues, by the formulas in ``tests/support/fsdp1_utils.py``, and that
nothing of the block is left on FSDP1 once it exited."""

from __future__ import annotations

from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fsdp_retain._common import ACTIVE_ATTR
from fsdp_retain._fsdp1._inspect import fsdp1_handles
from tests.support import fsdp1_utils as f1


def expect_counts(model, passes, keep, sync, strategy):
    def expect(counts) -> None:
        expected = dict(
            all_gather=f1.expected_all_gathers(model, passes, keep, strategy),
            reduce_scatter=f1.expected_reduce_scatters(model, passes, sync, strategy),
            all_reduce=f1.expected_all_reduces(model, passes, sync, strategy),
        )
        assert counts.as_dict() == expected, f"collectives {counts.by_op}, expected {expected}"

    return expect


def assert_restored(model) -> None:
    """FSDP1 looks as after a plain training step: nothing of the block is left."""
    assert not hasattr(model, ACTIVE_ATTR)
    assert f1.unsharded_storage_bytes(model) == 0, "unsharded storage kept after block"
    for module in FSDP.fsdp_modules(model):
        assert module._sync_gradients, "_sync_gradients not restored"
    for handle in fsdp1_handles(model):
        assert "reshard" not in handle.__dict__, "reshard override left installed"
        assert "pre_unshard" not in handle.__dict__, "pre_unshard override left installed"
        assert not hasattr(handle.flat_param, "_post_backward_hook_state")
        assert not handle._needs_pre_backward_unshard
        flat_param = handle.flat_param
        assert not hasattr(flat_param, "_saved_grad_shard"), "gradient left aside"
        grad = flat_param.grad
        assert grad is None or grad.shape == flat_param.shape, "unreduced gradient left"
