"""Per-loss gradients (block.grads, fsdp_retain/_loss_grads.py)."""
