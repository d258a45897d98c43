"""``python -m fsdp_retain.report``: the report's command line, or one rank it launched."""

import os
import sys

from ._cli import main
from ._launch import CONFIG_ENV, rank_main

if __name__ == "__main__":
    sys.exit(rank_main() if CONFIG_ENV in os.environ else main())
