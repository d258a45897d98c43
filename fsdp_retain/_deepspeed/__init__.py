"""The DeepSpeed backend (``deepspeed.initialize`` engines): every private DeepSpeed access
is in here. Never imports deepspeed itself."""

from ._block import DeepSpeedBlock, is_deepspeed_engine

__all__ = ["DeepSpeedBlock", "is_deepspeed_engine"]
