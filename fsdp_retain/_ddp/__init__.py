"""The DDP backend (``DistributedDataParallel``): every private DDP access is in here."""

from ._block import DDPBlock

__all__ = ["DDPBlock"]
