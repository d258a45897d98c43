"""The torch API that training code calls beside the block, one launch for all parts
(``tests/api/test_api_surface.py``): see each part's docstring.

The parts, registered here in this order: ``tests/api/cases_api_inputs.py``
(``backward(inputs=)`` and ``autograd.grad`` naming parameters, on the repository's
MLP), ``tests/api/cases_api_inputs_hf.py`` (the same on HF Qwen2 with peft LoRA and
gradient checkpointing), ``tests/api/cases_api_roots.py`` (a pass whose root is a
unit's own output),
``tests/api/cases_api_surface.py`` (``backward(gradient=)``, ``autograd.grad`` on
activations, explicit prefetch, meta-device init, checkpoints between steps, a
``no_grad`` forward between passes, several heads over one trunk).
"""

from tests.api import (
    cases_api_inputs,
    cases_api_inputs_hf,
    cases_api_roots,
    cases_api_surface,
)
from tests.support.case_parts import combined

registry = combined(
    cases_api_inputs,
    cases_api_inputs_hf,
    cases_api_roots,
    cases_api_surface,
)
