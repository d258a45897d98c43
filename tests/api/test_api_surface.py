"""The torch API that training code calls beside the block (CPU, gloo): what real
stacks do next to ``no_reshard_between_backwards`` rather than through its options.

- ``backward(inputs=...)`` / ``block.backward(..., inputs=...)`` and
  ``torch.autograd.grad`` naming the model's parameters, on FSDP2 and FSDP1
  (every strategy, original and flat parameters), every option
  (tests/api/cases_api_inputs.py); on HF Qwen2 with peft LoRA and gradient
  checkpointing (tests/api/cases_api_inputs_hf.py); a pass whose root is a unit's own
  output (tests/api/cases_api_roots.py).
- ``backward(gradient=)``, ``autograd.grad`` on activations, FSDP2 explicit
  prefetch, meta-device init, state dicts and a distributed checkpoint between steps,
  a ``no_grad`` forward between passes, several heads over one trunk
  (tests/api/cases_api_surface.py).

The rest of the family: tests/api/test_api_tp.py (FSDP2 with tensor parallelism, HSDP x
TP; the user's FSDP2 reshard settings), tests/fsdp1/test_api_fsdp1_prefetch.py (FSDP1
prefetch settings).
"""

from tests.support.harness import case_tests

case_tests(globals(), "tests.api.cases_api", {"test_api": (2, 900)})
