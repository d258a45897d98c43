"""Several backward passes over one forward under PyTorch FSDP1, FSDP2, DeepSpeed and DDP."""

from ._api import RetainBlock, SyncGrads, no_reshard_between_backwards
from ._loss_grads import LossGrads, apply_grads, combine, gramian

__all__ = [
    "LossGrads",
    "RetainBlock",
    "SyncGrads",
    "apply_grads",
    "combine",
    "gramian",
    "no_reshard_between_backwards",
]
__version__ = "0.1.0"
