"""``python -m fsdp_retain.report``: the report's command line, or one rank it launched.
It leaves through ``leave``: see [Note: the report leaves without the interpreter's
teardown] in ``_launch.py``."""

import os

from ._cli import main
from ._launch import CONFIG_ENV, leave, rank_main

if __name__ == "__main__":
    leave(rank_main() if CONFIG_ENV in os.environ else main())
