"""bergson's per-example gradient collector as a probe pass, then the policy loss, over one forward.

Run (2 processes on CPU; needs ``pip install bergson``, see docs/integrations/bergson.md):

    torchrun --nproc_per_node 2 examples/influence_bergson.py            # FSDP2 (fully_shard)
    torchrun --nproc_per_node 2 examples/influence_bergson.py --fsdp 1   # FSDP1

EleutherAI's bergson (data attribution) collects per-example gradients with a
forward hook and a full backward hook on every ``nn.Linear``: the forward hook
keeps the (randomly projected) input, the backward hook combines it with the
projected output gradient, so one backward of a summed loss gives each
sequence's projected weight gradient. Here its ``StreamingGradientCollector``
(the one its Hugging Face ``Trainer`` callback uses during training) records the
gradients of the response log-probabilities of an RL batch, and the policy
loss then trains the model. A tiny Qwen2 (random weights, nothing downloaded),
one FSDP unit per decoder layer, trains two copies side by side:

- the two-forward way: forward + collector + log-prob backward, ``zero_grad()``,
  a second forward + policy-loss backward;
- the block way: one forward inside ``no_reshard_between_backwards``, the
  log-prob backward as a probe pass (``block.backward(..., param_grads=False)``:
  the collector's hooks fire, no parameter gradient is computed or reduced),
  then the policy-loss backward.

Autograd captures a module's backward hooks at forward, so over the retained
graph bergson's hook fires in the policy-loss pass too; there it would fail
(``'Linear' object has no attribute '_inputs'``, or ``_name`` once the
collector has exited). ``ProbePassCollector`` keeps it to the probe pass by
reading ``block.probing``. The script prints the step times of both ways and
exits with status 1 unless the projections and the final parameters agree.
"""

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from _deps import require  # checking, not the point

require("bergson", why="examples/influence_bergson.py",
        pip="bergson==2.5.1 (docs/integrations/bergson.md)")

from bergson import GradientProcessor  # noqa: E402
from bergson.collector.gradient_collectors import StreamingGradientCollector  # noqa: E402

# New code #
from fsdp_retain import no_reshard_between_backwards  # noqa: E402


# New code #
class ProbePassCollector(StreamingGradientCollector):
    """bergson's streaming collector whose backward hook acts in probe passes only.

    Set ``collector.block`` to the running block. Over a retained graph the hook
    bergson registered at forward fires in every pass; outside a probe pass it
    returns before touching bergson's per-module state (``_inputs``, ``_name``).
    """

    block = None

    def backward_hook(self, module: nn.Module, g: torch.Tensor) -> None:
        if self.block is None or self.block.probing:
            super().backward_hook(module, g)


def build_model(device: torch.device) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=256,
        tie_word_embeddings=True, use_cache=False, attn_implementation="eager",
    )
    torch.manual_seed(0)  # same weights on every rank and for both ways
    with device:
        return Qwen2ForCausalLM(config)


def shard(model: nn.Module, fsdp: int, device: torch.device) -> nn.Module:
    """FSDP2 (``fully_shard``) or FSDP1, one unit per decoder layer plus the root."""
    if fsdp == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layer_cls = type(model.model.layers[0])
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), device_id=device
    )


def make_collector(cls, model: nn.Module, projection_dim: int) -> StreamingGradientCollector:
    """A collector on every Linear of the decoder (``base_model``, as bergson's own
    callback does), each gradient projected to ``projection_dim`` x ``projection_dim``."""
    processor = GradientProcessor(projection_dim=projection_dim)
    return cls(model=model.base_model, processor=processor, dtype=torch.float32)


def take(collector: StreamingGradientCollector) -> dict[str, torch.Tensor]:
    """The projected per-sequence gradients of the last backward, by module name."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # bergson copies them to the CPU without blocking
    grads = dict(collector.mod_grads)
    collector.mod_grads.clear()
    return grads


def token_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t >= 1, as (sequences x tokens-1)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def logp_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each sequence's response, summed over sequences:
    its per-sequence gradients are what bergson collects."""
    return -(logp * mask).sum()


def policy_loss(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    return -(advantages[:, None] * logp * mask).sum() / mask.sum()


def step_two_forward(model, optimizer, collector, ids, mask, advantages):
    with collector:
        logp = token_logprobs(model, ids)
        logp_loss(logp, mask).backward()
    projections = take(collector)
    optimizer.zero_grad()  # the log-prob gradients are not for training
    logp = token_logprobs(model, ids)  # the second forward the block removes
    policy_loss(logp, mask, advantages).backward()
    optimizer.step()
    optimizer.zero_grad()
    return projections


def step_block(model, optimizer, collector, ids, mask, advantages):
    # New code #
    with no_reshard_between_backwards(model, backwards=2) as block:
        collector.block = block  # its backward hook acts while block.probing
        with collector:
            logp = token_logprobs(model, ids)
            block.backward(logp_loss(logp, mask), param_grads=False, retain_graph=True)
        projections = take(collector)
        # bergson's hooks, captured at forward, fire again here and return at once.
        policy_loss(logp, mask, advantages).backward()
    optimizer.step()
    optimizer.zero_grad()
    return projections


def make_batch(step: int, sequences: int, tokens: int, vocab: int, device: torch.device):
    gen = torch.Generator().manual_seed(1000 * step + 100 * dist.get_rank() + 1)
    ids = torch.randint(vocab, (sequences, tokens), generator=gen)
    prompt_len = torch.randint(1, tokens // 2, (sequences, 1), generator=gen)
    mask = (torch.arange(1, tokens)[None, :] >= prompt_len).float()  # response tokens
    advantages = torch.randn(sequences, generator=gen)
    return ids.to(device), mask.to(device), advantages.to(device)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def global_max(value: float, device: torch.device) -> float:
    t = torch.tensor(value, device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def compare_projections(old: dict, new: dict) -> float:
    """Largest difference relative to each module's largest entry; inf if a module
    is missing on either side (the collector's hook did not run)."""
    if not old or old.keys() != new.keys():
        return float("inf")
    diff = 0.0
    for name, a in old.items():
        rel = (a - new[name]).abs().max() / a.abs().max().clamp_min(1e-30)
        diff = max(diff, rel.item())
    return diff


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--projection-dim", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def init_distributed() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def main() -> None:
    args = parse_args()
    device = init_distributed()
    ways = {"two_forward": step_two_forward, "block": step_block}
    collector_cls = {"two_forward": StreamingGradientCollector, "block": ProbePassCollector}

    base = build_model(device)
    models, optimizers, collectors, times = {}, {}, {}, {}
    for way in ways:
        model = base if way == "block" else copy.deepcopy(base)
        models[way] = shard(model, args.fsdp, device)
        optimizers[way] = torch.optim.SGD(models[way].parameters(), lr=args.lr, momentum=0.9)
        collectors[way] = make_collector(collector_cls[way], models[way], args.projection_dim)
        times[way] = []
    initial = [local(p).detach().clone() for p in models["two_forward"].parameters()]

    proj_diff = 0.0
    for step in range(args.steps):
        batch = make_batch(step, args.batch, args.seq_len, base.config.vocab_size, device)
        projections = {}
        for way, step_fn in ways.items():  # alternate, so both see the same machine load
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            projections[way] = step_fn(models[way], optimizers[way], collectors[way], *batch)
            if step >= args.warmup:
                times[way].append(time.perf_counter() - start)
        proj_diff = max(proj_diff, compare_projections(*projections.values()))

    param_diff = update = 0.0
    pairs = zip(models["two_forward"].parameters(), models["block"].parameters(), initial)
    for p_old, p_new, p_init in pairs:
        if local(p_old).numel():
            param_diff = max(param_diff, (local(p_old) - local(p_new)).abs().max().item())
            update = max(update, (local(p_old) - p_init).abs().max().item())
    proj_diff = global_max(proj_diff, device)
    param_diff, update = global_max(param_diff, device), global_max(update, device)
    ok = proj_diff <= 1e-4 and update > 0 and param_diff <= 1e-4 * update

    if dist.get_rank() == 0:
        names = list(projections["block"])
        old, new = (statistics.median(times[way]) * 1e3 for way in ways)
        print(
            f"Qwen2 tiny (3 layers, hidden 32), FSDP{args.fsdp}, {dist.get_world_size()} ranks, "
            f"{device.type}; {args.batch} sequences x {args.seq_len} tokens per rank per step; "
            f"{args.steps} steps ({args.warmup} warm-up)"
        )
        print(
            f"bergson: {len(names)} modules, {args.projection_dim}x{args.projection_dim} "
            f"projection each, first {min(names, default=None)!r}"
        )
        print(
            f"median step: two-forward {old:.1f} ms, block {new:.1f} ms: "
            f"{old / new:.2f}x ({100 * (1 - new / old):.0f}% of the step saved)"
        )
        print(f"projections: max relative difference block vs two-forward {proj_diff:.3g}")
        print(
            f"parameters after {args.steps} steps: max |difference| {param_diff:.3g} "
            f"(largest update {update:.3g})"
        )
        print("agreement: OK" if ok else "agreement: FAILED")
    dist.barrier()  # torch 2.13 + gloo can abort at exit when one rank destroys the group early
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
