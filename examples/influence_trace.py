"""RL actor update with influence tracing: a probe pass and a backward over one forward.

Run (2 processes on CPU with a tiny model; on GPUs set --nproc_per_node to your GPU count):

    torchrun --nproc_per_node 2 examples/influence_trace.py --size tiny
    torchrun --nproc_per_node 8 examples/influence_trace.py --size 1.5b
    torchrun --nproc_per_node 2 examples/influence_trace.py --size tiny --fsdp 1

The model is a Hugging Face Qwen2 causal LM built from ``Qwen2Config`` with the
published Qwen2.5 shapes and random weights (nothing is downloaded), sharded
with FSDP per decoder layer. Each optimizer step accumulates gradients over
``--micro-batches`` micro-batches (default 2), as verl's actor does: every
micro-batch but the last runs under FSDP2 ``set_requires_gradient_sync(False)``
/ FSDP1 ``no_sync()``. Per micro-batch:

1. one forward over a batch of sequences (prompt + response);
2. backward 1 on the log-probabilities of the response tokens, only for its
   hooks: hooks on every ``nn.Linear`` of every decoder layer keep, per
   sequence, a fixed random projection of that sequence's weight gradient
   (the per-sample gradients are never formed; see ``GradientProjector``).
   These projections are what influence tracing stores. Its parameter
   gradients are not wanted;
3. backward 2 on the policy-gradient loss, ``-advantage * log-prob``,
   accumulated over the micro-batches;

then ``optimizer.step()``.

``--mode two_forward`` is the usual way under FSDP: backward 1 and a
``zero_grad()`` for every micro-batch first (a ``zero_grad()`` between the
passes of one micro-batch would erase the earlier micro-batches), then a
second forward and backward 2 per micro-batch. ``--mode retain`` runs both
passes over one forward inside ``no_reshard_between_backwards``, backward 1 as
a probe pass (``block.backward(..., param_grads=False)``): no parameter
gradients, no weight-gradient matmuls, nothing reduced, and the accumulated
gradients left alone. ``--mode both`` (default) trains two copies of the model
from one initialisation, alternating steps, prints the median time of each
phase (per micro-batch) for both ways, and exits with status 1 unless the
projections and the final parameters agree.
"""

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn

# New code #
from fsdp_retain import no_reshard_between_backwards

# Published Qwen2.5 shapes (0.5B, 1.5B); "tiny" runs on CPU in seconds.
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
}
DEFAULT_SHAPE = {"tiny": (4, 64), "0.5b": (8, 512), "1.5b": (8, 512)}  # sequences/rank, tokens
PHASES = ("forward 1", "backward 1", "forward 2", "backward 2", "optimizer")


def build_model(size: str, device: torch.device) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **SIZES[size],
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(0)  # same weights on every rank and for both ways
    with device:
        return Qwen2ForCausalLM(config)


def shard(model: nn.Module, fsdp: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """FSDP2 (``fully_shard``) or FSDP1, one unit per decoder layer plus the root."""
    if fsdp == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layer_cls = type(model.model.layers[0])
    mp = None
    if dtype != torch.float32:
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), device_id=device, mixed_precision=mp
    )


class GradientProjector:
    """Per-sequence random projections of each decoder layer's weight gradients.

    For ``y = x @ W.T`` one sequence's gradient of ``W`` is ``sum_t g_t x_t^T``
    (``g_t`` the gradient of ``y`` at token t). Projected on both sides by fixed
    random matrices ``P_out`` (k_out x d_out) and ``P_in`` (k_in x d_in) it is
    ``sum_t (P_out g_t)(P_in x_t)^T``, k_out * k_in numbers, with k = d / factor.
    The forward hook keeps ``P_in x``; a hook on the output's gradient combines it
    with ``P_out g``, so the full per-sequence gradients are never formed.
    """

    def __init__(self, layers: nn.ModuleList, factor: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(1234)  # the same projection everywhere
        self._proj: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._inputs: dict[tuple[int, str], torch.Tensor] = {}
        self._out: dict[tuple[int, str], torch.Tensor] = {}
        self._recording = self._collecting = False
        for index, layer in enumerate(layers):
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear):
                    key = (index, name)
                    self._proj[key] = (
                        _random_projection(module.in_features, factor, gen).to(device),
                        _random_projection(module.out_features, factor, gen).to(device),
                    )
                    module.register_forward_hook(self._forward_hook(key))
        self.num_layers = len(layers)

    @contextlib.contextmanager
    def record_inputs(self):
        """Forward passes inside keep the projected inputs of every hooked Linear."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    @contextlib.contextmanager
    def collect(self):
        """Backward passes inside compute the per-sequence projections."""
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    def take(self) -> list[torch.Tensor]:
        """One (sequences x dims) tensor per decoder layer; clears the state."""
        per_layer = [
            torch.cat([self._out[key] for key in self._proj if key[0] == index], dim=1)
            for index in range(self.num_layers)
        ]
        self._inputs.clear()
        self._out.clear()
        return per_layer

    def _forward_hook(self, key):
        p_in, p_out = self._proj[key]

        def hook(module, args, output):
            if not self._recording:
                return
            self._inputs[key] = args[0].detach().float() @ p_in.T

            def on_output_grad(grad: torch.Tensor) -> None:
                # A retained graph runs this hook in every backward; keep backward 1's.
                if self._collecting:
                    projected = grad.float() @ p_out.T
                    per_seq = torch.einsum("bto,bti->boi", projected, self._inputs[key])
                    self._out[key] = per_seq.flatten(1)

            output.register_hook(on_output_grad)

        return hook


def _random_projection(dim: int, factor: int, gen: torch.Generator) -> torch.Tensor:
    k = max(1, dim // factor)
    return torch.randn(k, dim, generator=gen) / k**0.5


def token_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t >= 1, as (sequences x tokens-1) in float32."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def policy_loss(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    return -(advantages[:, None] * logp * mask).sum() / mask.sum()


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, list[float]] = defaultdict(list)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.times[phase].append(time.perf_counter() - start)


def maybe_no_sync(model: nn.Module, sync: bool):
    """Gradient accumulation: no gradient reduction unless ``sync`` (verl's shape)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()  # FSDP1


def step_two_forward(model, optimizer, projector, micro_batches, timer):
    projections = []
    for ids, mask, advantages in micro_batches:
        with timer("forward 1"), projector.record_inputs():
            logp = token_logprobs(model, ids)
        with timer("backward 1"), projector.collect():
            (logp * mask).sum().backward()
        projections.append(projector.take())
        optimizer.zero_grad()
    for i, (ids, mask, advantages) in enumerate(micro_batches):
        with maybe_no_sync(model, i == len(micro_batches) - 1):
            with timer("forward 2"):
                logp = token_logprobs(model, ids)  # the second forward this library removes
            with timer("backward 2"):
                (policy_loss(logp, mask, advantages) / len(micro_batches)).backward()
    with timer("optimizer"):
        optimizer.step()
        optimizer.zero_grad()
    return _concat(projections)


def step_retain(model, optimizer, projector, micro_batches, timer):
    projections = []
    for i, (ids, mask, advantages) in enumerate(micro_batches):
        # New code #
        # backwards=2: backward 2 frees each layer as soon as its gradients are
        # done. Backward 1 is a probe pass: it computes no parameter gradients
        # and reduces nothing, so only backward 2 reduce-scatters (in the
        # micro-batch that syncs).
        with maybe_no_sync(model, i == len(micro_batches) - 1), no_reshard_between_backwards(
            model, backwards=2
        ) as block:
            with timer("forward 1"), projector.record_inputs():
                logp = token_logprobs(model, ids)
            with timer("backward 1"), projector.collect():
                block.backward((logp * mask).sum(), param_grads=False, retain_graph=True)
            projections.append(projector.take())
            with timer("backward 2"):
                (policy_loss(logp, mask, advantages) / len(micro_batches)).backward()
    with timer("optimizer"):
        optimizer.step()
        optimizer.zero_grad()
    return _concat(projections)


def _concat(projections: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per layer, the projections of all micro-batches' sequences."""
    return [torch.cat(per_layer) for per_layer in zip(*projections)]


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--mode", choices=("two_forward", "retain", "both"), default="both")
    parser.add_argument(
        "--projection-dim-factor", type=int, default=32,
        help="each Linear's d_in and d_out are projected to d // factor",
    )
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank per micro-batch")
    parser.add_argument(
        "--micro-batches", type=int, default=2, help="micro-batches per optimizer step"
    )
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="default: 6 (tiny), 12")
    parser.add_argument("--warmup", type=int, default=None, help="default: 1 (tiny), 2")
    parser.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="compute dtype (FSDP mixed precision); auto: bfloat16 on GPU, float32 on CPU",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    tiny = args.size == "tiny"
    args.batch = args.batch or DEFAULT_SHAPE[args.size][0]
    args.seq_len = args.seq_len or DEFAULT_SHAPE[args.size][1]
    args.steps = args.steps or (6 if tiny else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    return args


def init_distributed() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def print_timings(timers: dict[str, PhaseTimer]) -> None:
    median = {
        mode: {phase: statistics.median(t) * 1e3 for phase, t in timer.times.items()}
        for mode, timer in timers.items()
    }
    print(f"{'median ms':<12}" + "".join(f"{mode:>13}" for mode in timers))
    for phase in PHASES + ("step",):
        row = (median[m].get(phase) for m in timers)
        print(f"{phase:<12}" + "".join(f"{'-':>13}" if ms is None else f"{ms:13.1f}" for ms in row))
    if len(timers) == 2:
        old, new = median["two_forward"]["step"], median["retain"]["step"]
        print(f"retain saves {100 * (1 - new / old):.0f}% of the step ({old / new:.2f}x faster)")


def check_agreement(models, initial, proj_diff, dtype, steps, device) -> bool:
    """Projections and parameters of the two ways agree (relative to the update size)."""
    param_diff = update = 0.0
    pairs = zip(models["two_forward"].parameters(), models["retain"].parameters(), initial)
    for p_old, p_new, p_init in pairs:
        if local(p_old).numel():
            param_diff = max(param_diff, (local(p_old) - local(p_new)).abs().max().item())
            update = max(update, (local(p_old) - p_init).abs().max().item())
    proj_diff = global_max(proj_diff, device)
    param_diff, update = global_max(param_diff, device), global_max(update, device)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = proj_diff <= tol and param_diff <= tol * update and update > 0
    if dist.get_rank() == 0:
        print(f"projections: max relative difference retain vs two_forward {proj_diff:.3g}")
        print(
            f"parameters after {steps} steps: max |difference| {param_diff:.3g} "
            f"(largest update {update:.3g})"
        )
        print("agreement: OK" if ok else "agreement: FAILED")
    return ok


def main() -> None:
    args = parse_args()
    from _deps import require  # checking, not the point

    require("transformers", why="examples/influence_trace.py", extra="examples")
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    modes = ("two_forward", "retain") if args.mode == "both" else (args.mode,)
    step_fns = {"two_forward": step_two_forward, "retain": step_retain}

    base = build_model(args.size, device)
    vocab, params = base.config.vocab_size, sum(p.numel() for p in base.parameters())
    models, optimizers, projectors, timers = {}, {}, {}, {}
    for mode in modes:
        model = base if mode == modes[-1] else copy.deepcopy(base)
        projectors[mode] = GradientProjector(model.model.layers, args.projection_dim_factor, device)
        models[mode] = shard(model, args.fsdp, device, dtype)
        optimizers[mode] = torch.optim.SGD(models[mode].parameters(), lr=args.lr, momentum=0.9)
        timers[mode] = PhaseTimer(device)
    del base
    initial = []  # parameters before training, to size the updates in the check
    if len(modes) == 2:
        initial = [local(p).detach().clone() for p in models["two_forward"].parameters()]

    proj_diff, proj_dims = 0.0, 0
    for step in range(args.steps):
        micro_batches = [
            make_batch(args.micro_batches * step + i, args.batch, args.seq_len, vocab, device)
            for i in range(args.micro_batches)
        ]
        projections = {}
        for mode in modes:  # alternate the ways so both see the same machine load
            timer = timers[mode] if step >= args.warmup else PhaseTimer(device)
            with timer("step"):
                projections[mode] = step_fns[mode](
                    models[mode], optimizers[mode], projectors[mode], micro_batches, timer
                )
        proj_dims = sum(p.shape[1] for p in projections[modes[0]])
        if len(modes) == 2:
            for a, b in zip(projections["two_forward"], projections["retain"]):
                rel = (a - b).abs().max() / a.abs().max().clamp_min(1e-30)
                proj_diff = max(proj_diff, rel.item())

    if rank == 0:
        print(
            f"Qwen2 {args.size} ({params / 1e6:.1f}M params, random weights), FSDP{args.fsdp}, "
            f"{world} ranks, {device.type}, {dtype_name}; {args.micro_batches} micro-batches of "
            f"{args.batch} sequences x {args.seq_len} tokens per rank per step; "
            f"{args.steps} steps ({args.warmup} warm-up)"
        )
        print(
            f"gradient projections: {projectors[modes[0]].num_layers} layers, {proj_dims} "
            f"numbers per sequence (projection dim factor {args.projection_dim_factor})"
        )
        print_timings(timers)
    ok = True
    if len(modes) == 2:
        ok = check_agreement(models, initial, proj_diff, dtype, args.steps, device)
    dist.barrier()  # torch 2.13 + gloo can abort at exit when one rank destroys the group early
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
