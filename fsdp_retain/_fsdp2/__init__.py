"""The FSDP2 backend (``fully_shard``): every private FSDP2 access is in here."""

from ._block import FSDP2Block
from ._compat import is_fsdp2_module

__all__ = ["FSDP2Block", "is_fsdp2_module"]
