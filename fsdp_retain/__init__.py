"""Several backward passes over one forward under PyTorch FSDP1, FSDP2 and DeepSpeed ZeRO-3."""

from ._api import RetainBlock, SyncGrads, no_reshard_between_backwards

__all__ = ["RetainBlock", "SyncGrads", "no_reshard_between_backwards"]
__version__ = "0.1.0"
