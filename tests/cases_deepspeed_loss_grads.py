"""Per-loss gradients on DeepSpeed ZeRO-3 (CPU, gloo): ``block.grads(loss)`` reads ZeRO-3's
gradient partitions (``fsdp_retain/_deepspeed_grads.py``), ``apply_grads`` writes them.

The tiny Qwen2 of ``cases_deepspeed_common`` and three conflicting losses over one
forward; the reference is the one-process method on the unsharded copy, as in
``tests/cases_loss_grads.py`` (each loss's gradient by ``torch.autograd.grad``,
averaged over ranks, their Gramian, the method's weights, the weighted sum as
``.grad``, an SGD-momentum step). Over 3 steps the Gramian and the weights match it
(1e-5 relative: fp32 sums of ~300) and the parameters within 1e-6; PCGrad and torchjd's UPGrad,
``keep_unsharded`` True and False. Also: a normal ``engine.backward`` pass before
the ``block.grads`` passes keeps its gradient (the partitions are put back), and
fp16 (ZeRO-3's loss scale) is refused before any pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from tests.cases_deepspeed_common import ds_config, full_params, losses, make_engine, tokens
from tests.cases_loss_grads import METHODS
from tests.harness import Registry
from tests.parity import world

registry = Registry()
STEPS = 3
K = 3
CLOSE = dict(rtol=1e-6, atol=1e-6)
# The Gramian's entries reach ~300: fp32 sums in ZeRO-3's and the reference's orders.
GRAM_CLOSE = dict(rtol=1e-5, atol=1e-6)


def _reference_step(ref, opt, x, weigh, plain_first: bool):
    logits = ref(x).logits
    params = [p for p in ref.parameters() if p.requires_grad]
    passes = losses(logits, K + plain_first)
    per_loss = []
    for i, loss in enumerate(passes):
        grads = torch.autograd.grad(loss, params, retain_graph=i < len(passes) - 1)
        grads = [g.detach().clone() for g in grads]
        for g in grads:
            dist.all_reduce(g)
            g /= world()
        per_loss.append(grads)
    plain = per_loss.pop(0) if plain_first else None
    flat = [torch.cat([g.reshape(-1) for g in gs]).to(torch.float64) for gs in per_loss]
    gram = torch.stack(flat) @ torch.stack(flat).T
    weights = weigh(gram)
    for index, (p, *gs) in enumerate(zip(params, *per_loss)):
        p.grad = sum(float(w) * g for w, g in zip(weights, gs))
        if plain is not None:
            p.grad = p.grad + plain[index]
    opt.step()
    opt.zero_grad()
    return gram, weights


def _parity(method: str, keep: bool, plain_first: bool = False) -> None:
    engine, ref = make_engine(ds_config())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    weigh = METHODS[method]
    for step in range(STEPS):
        x = tokens(step)
        ref_gram, ref_weights = _reference_step(ref, ref_opt, x, weigh, plain_first)
        with no_reshard_between_backwards(engine, keep_unsharded=keep) as block:
            passes = losses(engine(x).logits, K + plain_first)
            if plain_first:
                engine.backward(passes.pop(0), retain_graph=True)
            grads = [block.grads(loss, retain_graph=i < K - 1) for i, loss in enumerate(passes)]
            assert block.backward_passes == K + plain_first
            gram = fsdp_retain.gramian(grads)
            torch.testing.assert_close(gram, ref_gram, **GRAM_CLOSE)
            weights = weigh(gram)
            torch.testing.assert_close(weights, ref_weights, **CLOSE)
            fsdp_retain.apply_grads(fsdp_retain.combine(grads, weights))
        engine.step()
        expected = {n: p.detach() for n, p in ref.named_parameters()}
        actual = full_params(engine)
        for name, value in expected.items():
            torch.testing.assert_close(actual[name], value, **CLOSE,
                                       msg=lambda m, n=name: f"step {step}: {n}: {m}")


for _method in ("pcgrad", "upgrad"):
    registry.add(f"ds_loss_grads_{_method}", lambda m=_method: _parity(m, keep=True))
registry.add("ds_loss_grads_pcgrad_regather", lambda: _parity("pcgrad", keep=False))
registry.add("ds_loss_grads_after_plain_pass", lambda: _parity("pcgrad", True, plain_first=True))


@registry.case()
def ds_loss_grads_fp16_refused() -> None:
    # An fp16 engine needs an accelerator; the check reads only fp16_enabled().
    engine, _ = make_engine(ds_config())
    engine.fp16_enabled = lambda: True
    with no_reshard_between_backwards(engine) as block:
        loss = losses(engine(tokens(0)).logits, 1)[0]
        try:
            block.grads(loss)
        except ValueError as exc:
            assert "bf16" in str(exc), exc
        else:
            raise AssertionError("block.grads with fp16 was not refused")
        assert block.backward_passes == 0
        engine.backward(loss)
    engine.step()
