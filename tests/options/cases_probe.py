"""Probe passes (``block.backward(loss, param_grads=False)``), run inside ranks by
``tests/options/test_probe.py`` (CPU, gloo, world size 2; 4 for ``reshard_to``).

The cases live in parts, registered here in this order:

- ``tests/options/cases_probe_parity.py``: parity against an unsharded reference for
  every backend flavour, option and pass pattern; the plain way; misuse; freeing.
- ``tests/options/cases_probe_shown.py``: what a probe pass leaves ``model.parameters()``
  showing on FSDP2 (the registered parameters and their ``.grad``), in gradient
  accumulation.
"""

from tests.options import cases_probe_parity, cases_probe_shown
from tests.support.case_parts import combined

registry = combined(cases_probe_parity, cases_probe_shown)
