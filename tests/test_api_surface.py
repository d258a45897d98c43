"""The torch API that training code calls beside the block (CPU, gloo): what real
stacks do next to ``no_reshard_between_backwards`` rather than through its options.

- ``backward(inputs=...)`` / ``block.backward(..., inputs=...)`` and
  ``torch.autograd.grad`` naming the model's parameters, on FSDP2 and FSDP1
  (every strategy, original and flat parameters), every option
  (tests/cases_api_inputs.py); on HF Qwen2 with peft LoRA and gradient
  checkpointing (tests/cases_api_inputs_hf.py).
"""

from tests.harness import case_tests

case_tests(globals(), "tests.cases_api", {"test_api": (2, 900)})
