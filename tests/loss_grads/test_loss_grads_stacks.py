"""Per-loss gradients on frozen and tied parameters, peft LoRA, gradients applied
after the block, ``zero_grad()`` between passes and over a named set of parameters
(the shared trunk; torchjd's ``mtl_backward`` as the reference), on FSDP2 and FSDP1
(flat and original parameters, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), every
``keep_unsharded`` value; HSDP (FSDP1 HYBRID_SHARD, FSDP2 on a 2-D mesh) on 4 ranks
(tests/loss_grads/cases_loss_grads_stacks.py)."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.loss_grads.cases_loss_grads_stacks", {
    "test_loss_grads_stacks": (2, 900),
    "test_loss_grads_stacks_hsdp": (4, 900),
})
