"""DDP (DistributedDataParallel) backend, CPU/gloo, world size 2: parity with the
unwrapped model over 3 steps across sync_grads, backwards=, probe passes and DDP's
settings (static_graph, find_unused_parameters, gradient_as_bucket_view, small
buckets, fp16/bf16 compression hooks, a bf16 model), with the plain DDP passes wrong
beside each, and all-reduces counted per bucket (tests/cases_ddp.py)."""

from tests.harness import case_tests

case_tests(globals(), "tests.cases_ddp", {"test_ddp": (2, 600)})
