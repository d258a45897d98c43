"""The memory report (fsdp_retain/report/)."""
