"""The block's API beside what training code calls, backend-independent: exports, the policy,
the torch API next to the block, tensor parallelism, the stacks' wrappers, the step guard,
saved-tensor integrity, missing internals, property-based parity."""
