"""The DeepSpeed backend (fsdp_retain/_deepspeed/): ZeRO-0 to 3, in the DeepSpeed venv."""
