"""Configurations from real training stacks (CPU/gloo): HF Qwen2 with reentrant and
non-reentrant gradient checkpointing on FSDP1 (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD
at world size 4; both use_orig_params) and FSDP2, every option, probe passes;
torch.utils.checkpoint(use_reentrant=True) inside and around units; a forward before
the block; the FSDP1 guards; peft LoRA; a byte budget; HF Qwen2 and LoRA on DDP; HF
Qwen2 with a tiled MLP (axolotl's and Liger's patch) on FSDP2, FSDP1 and DDP with probe
passes (tests/real_stacks/cases_real_stacks.py).
FSDP2 HSDP, activation offload, two models in two blocks
(tests/real_stacks/cases_real_stacks_compose.py)."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.real_stacks.cases_real_stacks", {
    "test_real_stacks": (2, 1200),
    "test_real_stacks_hybrid_ws4": (4, 900),
})
case_tests(globals(), "tests.real_stacks.cases_real_stacks_compose", {
    "test_real_stacks_compose": (2, 900),  # activation offload; two models in two nested blocks
    "test_real_stacks_compose_ws4": (4, 900),  # FSDP2 HSDP on a 2 x 2 mesh
})
