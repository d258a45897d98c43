"""The block's options across backends: keep_unsharded as a byte budget, reshard_to, probe
passes."""
