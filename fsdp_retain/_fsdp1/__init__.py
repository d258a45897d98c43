"""The FSDP1 backend (``FullyShardedDataParallel``): every private FSDP1 access is in here."""

from ._block import FSDP1Block
from ._units import shard_groups

__all__ = ["FSDP1Block", "shard_groups"]
