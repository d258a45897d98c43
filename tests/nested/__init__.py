"""Nested backward passes (fsdp_retain/_nested.py) on every FSDP backend."""
