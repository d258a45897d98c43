"""The DDP backend (``DistributedDataParallel`` and the composable ``replicate``): every
private DDP access is in here."""

from ._block import DDPBlock
from ._wrappers import composable_states, ddp_model

__all__ = ["DDPBlock", "composable_states", "ddp_model"]
