"""One training step: two losses from one forward (two forwards for ``two_forward``)."""

from __future__ import annotations

import contextlib

from ._hooks import NO_HOOKS, StepHooks
from ._modes import Mode


def token_logprobs(model, ids):
    """Log-probability of each next token, from one forward."""
    import torch

    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    picked = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked.float() - torch.logsumexp(logits, dim=-1).float()


def logprob_loss(logp):
    return -logp.mean()


def policy_loss(logp, advantages):
    return -(advantages[:, None] * logp).mean()


def train_step(
    model, optimizer, batch, mode: Mode, hooks: StepHooks = NO_HOOKS,
    unsharded_bytes: int | None = None,
) -> None:
    """One optimizer step with the log-prob loss and the policy loss, run as ``mode`` says."""
    ids, advantages = batch
    step = mode.spec.step
    if step == "recipe":
        from ._fsdp2_steps import recipe_step

        recipe_step(model, lambda: token_logprobs(model, ids),
                    lambda logp: [logprob_loss(logp), policy_loss(logp, advantages)],
                    hooks, sync_last=mode.sync_grads == "last")
    elif step in ("accumulate", "accumulate_gathered"):
        from ._fsdp2_steps import accumulate_step

        accumulate_step(
            model, lambda: _one_forward(model, batch, mode, hooks, unsharded_bytes),
            user_gathered=step == "accumulate_gathered",
        )
    elif mode.spec.forwards == 2:
        with hooks.segment():
            logp = token_logprobs(model, ids)
            hooks.mark("backward1_start")
            logprob_loss(logp).backward()
            hooks.mark("backward1_end")
            del logp
        hooks.mark("forward2_start")
        with hooks.segment():
            logp = token_logprobs(model, ids)
            hooks.mark("forward2_end")
            policy_loss(logp, advantages).backward()
            del logp
    else:
        _one_forward(model, batch, mode, hooks, unsharded_bytes)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _one_forward(model, batch, mode: Mode, hooks: StepHooks,
                 unsharded_bytes: int | None) -> None:
    """One forward and ``mode.spec.passes`` backward passes over it (one: of the two
    losses' sum), in a block if ``mode`` uses the library."""
    from .. import no_reshard_between_backwards

    ids, advantages = batch
    block = (
        no_reshard_between_backwards(model, **mode.block_options(unsharded_bytes))
        if mode.uses_library
        else contextlib.nullcontext()
    )
    with hooks.segment(), block as blk:
        logp = token_logprobs(model, ids)
        if mode.spec.passes == 1:
            (logprob_loss(logp) + policy_loss(logp, advantages)).backward()
            return
        hooks.mark("backward1_start")
        if mode.spec.probe:
            assert blk is not None, mode
            blk.backward(logprob_loss(logp), param_grads=False, retain_graph=True)
        else:
            logprob_loss(logp).backward(retain_graph=True)
        hooks.mark("backward1_end")
        policy_loss(logp, advantages).backward()
        del logp
