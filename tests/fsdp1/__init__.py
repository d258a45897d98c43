"""The FSDP1 backend (fsdp_retain/_fsdp1/): parity grids, composability, misuse, leaks,
prefetch."""
