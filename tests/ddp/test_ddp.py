"""DDP (DistributedDataParallel) backend, CPU/gloo, world size 2: parity with the
unwrapped model over 3 steps across sync_grads, backwards=, probe passes and DDP's
settings (static_graph, find_unused_parameters, gradient_as_bucket_view, small
buckets, fp16/bf16 compression hooks, a bf16 model), with the plain DDP passes wrong
beside each, and all-reduces counted per bucket (tests/ddp/cases_ddp.py). The composable
replicate (DDP's reducer; plain and device_mesh=, static_graph, find_unused_parameters,
an fp16 hook, set_requires_gradient_sync accumulation, per-block torch.compile as
torchtitan and OLMo-core set it up) and the refusal of a wrapper the block does not take
(tests/ddp/cases_ddp_replicate.py). Both share the session's one launch of 2 ranks."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.ddp.cases_ddp", {"test_ddp": (2, 600)})
case_tests(globals(), "tests.ddp.cases_ddp_replicate", {"test_ddp_replicate": (2, 600)})
