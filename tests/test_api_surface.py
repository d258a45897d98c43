"""The torch API that training code calls beside the block (CPU, gloo): what real
stacks do next to ``no_reshard_between_backwards`` rather than through its options.

- ``backward(inputs=...)`` / ``block.backward(..., inputs=...)`` and
  ``torch.autograd.grad`` naming the model's parameters, on FSDP2 and FSDP1
  (every strategy, original and flat parameters), every option
  (tests/cases_api_inputs.py); on HF Qwen2 with peft LoRA and gradient
  checkpointing (tests/cases_api_inputs_hf.py); a pass whose root is a unit's own
  output (tests/cases_api_roots.py).
- FSDP2 with tensor parallelism on a 2 x 2 mesh, every option, probe passes, loss
  parallel (world size 4); the user's ``set_reshard_after_backward(False)`` across
  micro-batches (tests/cases_api_fsdp2_mesh.py).
"""

from tests.harness import case_tests

case_tests(globals(), "tests.cases_api", {"test_api": (2, 900), "test_api_ws4": (4, 900)})
