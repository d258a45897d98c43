"""Configurations from real training stacks: HF models, checkpointing, LoRA, torch.compile,
tiled kernels."""
