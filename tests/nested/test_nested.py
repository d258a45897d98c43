"""Nested backward passes (a backward inside a backward) on FSDP2 and FSDP1, CPU/gloo,
float64: a tiled MLP (DeepSpeed/axolotl style, tiles inside the MLP's forward as Liger
and axolotl write it, checkpointed tiles, a tile through two units, per-tile
autograd.grad refused) and a cached GradCache loss (replayed after the loss's backward
or from a hook on it, as sentence-transformers does), across the block's options, FSDP1
flat and original parameters with frozen and tied ones, HSDP on 4 ranks: parity with one
process on the union batch within 1e-9 over 3 steps, collectives per step independent
of the number of tiles and mini-batches, and the plain wrappers' behaviour beside them
(tests/nested/cases_nested.py)."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.nested.cases_nested", {
    "test_nested": (2, 900),
    "test_nested_ws4": (4, 600),
})
