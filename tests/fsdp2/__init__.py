"""The FSDP2 backend (fsdp_retain/_fsdp2/): parity grid, state and memory, composability."""
