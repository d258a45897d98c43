"""The DDP backend (fsdp_retain/_ddp/): DistributedDataParallel and the composable replicate."""
