"""Probe passes (block.backward(loss, param_grads=False)), CPU/gloo, world size 2, one launch.

FSDP1 FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (both use_orig_params) and FSDP2
(reshard_after_forward True and False), each with 1 and 2 micro-batches per
step (the first under no_sync() / set_requires_gradient_sync(False)); inside
each case every keep_unsharded x sync_grads x backwards x pass pattern (pn, np,
pnp, npn). Activation-hook gradients of probe passes, final gradients and
parameters match an unsharded reference over 3 SGD-momentum steps; probe
passes leave .grad alone and reduce nothing (collectives counted). Also: the
plain way (.backward() of the probe loss + zero_grad()) is wrong under
accumulation; with keep_unsharded=False a probe pass frees each unit after its
backward (FSDP1 FULL_SHARD, FSDP2); misuse gets clear errors.
"""

from tests.support.harness import case_tests

case_tests(globals(), "tests.options.cases_probe", {
    "test_probe": (2, 600),
    "test_probe_ws4": (4, 300),
})
