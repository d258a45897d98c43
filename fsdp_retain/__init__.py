"""Several backward passes over one forward under PyTorch FSDP (FSDP1 and FSDP2)."""

from ._api import no_reshard_between_backwards
from ._common import RetainOptions

__all__ = ["no_reshard_between_backwards", "RetainOptions"]
__version__ = "0.1.0"
