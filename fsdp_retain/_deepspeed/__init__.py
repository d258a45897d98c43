"""The DeepSpeed backend (``deepspeed.initialize`` engines): every private DeepSpeed access
is in here. Never imports deepspeed itself."""

from ._block import DeepSpeedBlock
from ._engine import is_deepspeed_engine, zero_stage
from ._zero12 import DeepSpeedZero12Block

__all__ = ["DeepSpeedBlock", "DeepSpeedZero12Block", "is_deepspeed_engine", "zero_stage"]
