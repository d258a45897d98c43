"""What the DeepSpeed ZeRO-3 case parts share (no cases of its own; CPU, gloo).

A tiny random Qwen2 (norms, embeddings, untied head) under ZeRO-3 with
``stage3_param_persistence_threshold: 0``, so that no parameter stays
resident and a released one fails loudly. The reference is an unsharded copy
trained with the same SGD-momentum; see ``tests/support/parity.py`` for seeds.
``Scenario`` says what one micro-batch does (passes, where each starts, which
forward it runs over, where the forwards run); ``run_parity`` checks it over
several optimizer steps.

Collectives are counted by wrapping ``torch.distributed`` before DeepSpeed's
communication backend binds its functions (``setup`` below).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from transformers import Qwen2Config, Qwen2ForCausalLM

from fsdp_retain import no_reshard_between_backwards
from tests.support.harness import skip_case
from tests.support.parity import LOSSES, assert_close_dicts, rank, step_averaged


_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
}
COUNTS: collections.Counter = collections.Counter()
_counting = [False]


def _counted(kind: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _counting[0]:
            COUNTS[kind] += 1
        return fn(*args, **kwargs)

    return wrapper


@functools.cache
def setup() -> None:
    """Wraps the collectives, then lets DeepSpeed bind them (once per rank)."""
    for name, kind in _KINDS.items():
        wrapped = _counted(kind, getattr(dist, name))
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)
    deepspeed.init_distributed(dist_backend="gloo")


VOCAB, SEQ, BATCH = 128, 8, 2
TOL = dict(rtol=1e-4, atol=1e-5)
# Gradient accumulation (gas > 1): DeepSpeed sums the micro-batches in its own buffer
# and order; after 3 momentum steps fp32 reassociation reaches ~1.6e-5 on gradients of
# ~1e-2 (seen with deepspeed 0.19.8, transformers 5.23, torch 2.13). A wrong pass is off
# by ~1e-3 and more.
TOL_ACCUMULATED = dict(rtol=1e-4, atol=5e-5)
# bf16 gradients are reduced and accumulated in bf16: compare each tensor's
# largest error with its largest value, plus a floor from the largest value of
# all tensors for the near-zero ones (attention key biases). A lost or doubled
# pass is off by ~100%; the reference runs in fp32, so bf16 forward rounding
# adds up over 3 steps (a few percent on the norm weights).
BF16_SCALE_TOL = 5e-2
BF16_FLOOR_TOL = 2e-3


@contextlib.contextmanager
def counting():
    COUNTS.clear()
    _counting[0] = True
    try:
        yield COUNTS
    finally:
        _counting[0] = False


def make_model() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(42)
    return Qwen2ForCausalLM(config)


def ds_config(stage: int = 3, gas: int = 1, bf16: bool = False, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            # Deterministic collectives: no prefetch, free right after use.
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            **zero,
        },
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def make_engine(config: dict):
    setup()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    engine, *_ = initialize(model, opt, config)
    return engine, ref


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict):
    """``deepspeed.initialize``; the case is skipped (``skip_case``) where the config
    enables a dtype DeepSpeed's accelerator refuses on this machine, asked as
    ``initialize`` asks it (``is_fp16_supported``: on CPU, oneDNN's fp16 support)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for dtype in ("fp16", "bf16"):
        supported = getattr(accelerator, f"is_{dtype}_supported")()
        if config.get(dtype, {}).get("enabled") and not supported:
            skip_case(f"{dtype} needs DeepSpeed's {accelerator.device_name()} accelerator to "
                      f"support it, and {type(accelerator).__name__}.is_{dtype}_supported() "
                      "is false on this machine (on CPU: "
                      f"torch.ops.mkldnn._is_mkldnn_{dtype}_supported())")
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)


def tokens(step: int, micro: int = 0, forward: int = 0) -> torch.Tensor:
    seed = 42 + rank() + 1 + 1000 * step + 100 * micro + 10 * forward
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def losses(logits: torch.Tensor, passes: int) -> list:
    logits = logits.float()
    return [LOSSES[i % len(LOSSES)](logits) for i in range(passes)]


def full_grads(engine) -> dict:
    grads = {}
    for name, param in engine.module.named_parameters():
        grad = safe_get_full_grad(param)
        grads[name] = None if grad is None else grad.detach().float().clone()
    return grads


def full_params(engine) -> dict:
    """The optimizer's fp32 parameters by name (frozen ones have none: left out)."""
    return {
        n: safe_get_full_fp32_param(p).detach().clone()
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }


def assert_close(
    actual: dict, expected: dict, what: str, bf16: bool = False, tol: dict = TOL
) -> None:
    assert set(actual) == set(expected), f"{what}: names differ"
    floor = BF16_FLOOR_TOL * max(v.abs().max().item() for v in expected.values())
    for name, value in expected.items():
        assert actual[name] is not None, f"{what}: {name} has no gradient"
        if bf16:
            error = (actual[name] - value).abs().max().item()
            scale = value.abs().max().item()
            assert error <= BF16_SCALE_TOL * scale + floor, f"{what}: {name}: error {error}, scale {scale}"
    if not bf16:  # in one comparison where all are plain fp32 (tests/support/parity.py)
        assert_close_dicts(actual, expected, what, tol)


@dataclasses.dataclass
class Scenario:
    passes: int = 2
    keep: bool = True
    sync: str = "every"
    backwards: bool = False
    engine_backward: bool = True
    gas: int = 1
    bf16: bool = False
    steps: int = 3
    use_block: bool = True
    probe_first: bool = False  # pass 1 is block.backward(..., param_grads=False)
    persist: bool = False  # DeepSpeed's default persistence threshold: all resident
    check: bool = False  # check_saved_tensors
    zero_between: bool = False  # engine.optimizer.zero_grad() before each later pass
    # The last pass starts inside the model, at decoder layer 0's output: it never
    # reaches the engine's output, nor the later layers, the final norm and the head.
    inner_last: bool = False
    inner_first: bool = False  # the same for the first pass
    # Forwards per micro-batch, each on its own tokens; pass i runs over forward
    # i % forwards. All run before the first pass, or with ``interleave`` each
    # right before the first pass over it.
    forwards: int = 1
    interleave: bool = False
    forward_outside: bool = False  # forward 0 runs before the block is entered
    mixed: bool = False  # every pass's loss sums its loss over all the forwards
    hpz: int = 0  # ZeRO++'s zero_hpz_partition_size (0: not configured)

    def options(self) -> dict:
        return dict(
            keep_unsharded=self.keep,
            sync_grads=self.sync,
            backwards=self.passes if self.backwards else None,
            check_saved_tensors=self.check,
        )

    def starts_inside(self, index: int) -> bool:
        """Whether pass ``index`` (0-based) starts at decoder layer 0's output."""
        return (self.inner_first and index == 0) or (
            self.inner_last and index == self.passes - 1
        )

    @property
    def inner(self) -> bool:
        return self.inner_first or self.inner_last


@contextlib.contextmanager
def layer0_output(model, enabled: bool = True):
    """Yields a list that gets the output of ``model``'s decoder layer 0 in each forward."""
    kept: list = []
    if not enabled:
        yield kept
        return

    def keep(module, args, output):
        kept.append(output[0] if isinstance(output, tuple) else output)

    handle = model.model.layers[0].register_forward_hook(keep)
    try:
        yield kept
    finally:
        handle.remove()


def pass_loss(outs: list, kept: list, scenario: Scenario, index: int) -> torch.Tensor:
    """The loss of pass ``index`` (0-based) over the forward it runs over.

    ``outs[k]`` and ``kept[k]`` are forward k's logits and decoder layer 0 output.
    """
    if scenario.mixed:
        return sum(LOSSES[index % len(LOSSES)](out.float()) for out in outs)
    forward = index % scenario.forwards
    if scenario.starts_inside(index):
        return torch.tanh(kept[forward].float()).pow(2).mean()
    return LOSSES[index % len(LOSSES)](outs[forward].float())


def reference_step(ref, opt, scenario: Scenario, step: int) -> dict:
    for micro in range(scenario.gas):
        with layer0_output(ref, scenario.inner) as kept:
            outs = [ref(tokens(step, micro, k)).logits for k in range(scenario.forwards)]
        for i in range(scenario.passes):
            if scenario.probe_first and i == 0:
                continue
            if scenario.zero_between and i > 0:
                opt.zero_grad()
            loss = pass_loss(outs, kept, scenario, i)
            (loss / scenario.gas).backward(retain_graph=i < scenario.passes - 1)
    return step_averaged(ref, opt)


def engine_micro_step(engine, scenario: Scenario, step: int, micro: int) -> None:
    block = (
        no_reshard_between_backwards(engine, **scenario.options())
        if scenario.use_block
        else contextlib.nullcontext()
    )
    outs: list = []

    def forward_until(count: int) -> None:
        while len(outs) < count:
            outs.append(engine(tokens(step, micro, len(outs))).logits)

    with layer0_output(engine.module, scenario.inner) as kept:
        if scenario.forward_outside:
            forward_until(1)
        with block as b:
            if not scenario.interleave:
                forward_until(scenario.forwards)
            for i in range(scenario.passes):
                forward_until(i % scenario.forwards + 1)
                loss = pass_loss(outs, kept, scenario, i)
                retain = i < scenario.passes - 1
                if scenario.zero_between and i > 0:
                    engine.optimizer.zero_grad()
                if scenario.probe_first and i == 0:
                    b.backward(loss, param_grads=False, retain_graph=True)
                elif scenario.engine_backward:
                    engine.backward(loss, retain_graph=retain)
                else:
                    loss.backward(retain_graph=retain)
            if scenario.use_block:
                assert b.backward_passes == scenario.passes, (b.backward_passes, scenario)


def expected_counts(engine, scenario: Scenario) -> dict:
    """Collectives per micro-batch, from ZeRO-3's rules with prefetch off.

    Forward: one all-gather per module that owns parameters (its parameters
    coalesced). ``keep_unsharded=True``: a later forward finds them gathered,
    and no backward all-gathers. Otherwise every forward gathers and every
    pass re-gathers every such module, except that a probe pass never walks
    the embedding (its input, token ids, needs no gradient; see [Note: probe
    passes]), and a pass from decoder layer 0's output (``inner_first``,
    ``inner_last``) walks only the embedding and layer 0. Gradients:
    one reduce-scatter per reduction round (the default bucket holds every
    gradient of this model): per pass with ``"every"``, once per micro-batch
    with ``"last"``.
    """
    modules = [
        m for m in engine.module.modules() if any(True for _ in m.parameters(recurse=False))
    ]
    model = engine.module.model
    below = {id(m) for part in (model.embed_tokens, model.layers[0]) for m in part.modules()}
    walked = [
        sum(id(m) in below for m in modules) if scenario.starts_inside(i) else len(modules)
        for i in range(scenario.passes)
    ]
    real_passes = scenario.passes - int(scenario.probe_first)
    gathers = len(modules)
    if not scenario.keep:
        gathers = scenario.forwards * len(modules) + sum(walked) - int(scenario.probe_first)
    rounds = real_passes if scenario.sync == "every" else 1
    return {"all_gather": gathers, "reduce_scatter": rounds}


def run_parity(scenario: Scenario, check_counts: bool = True) -> None:
    zero: dict = dict(stage3_param_persistence_threshold=100_000) if scenario.persist else {}
    if scenario.hpz:
        zero["zero_hpz_partition_size"] = scenario.hpz
    engine, ref = make_engine(ds_config(gas=scenario.gas, bf16=scenario.bf16, **zero))
    check_counts = check_counts and not scenario.persist
    persistent = [p.ds_persist for p in engine.module.parameters()]
    assert all(persistent) if scenario.persist else not any(persistent), persistent
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    dtype = next(engine.module.parameters()).dtype
    assert dtype == (torch.bfloat16 if scenario.bf16 else torch.float32), dtype
    tol = TOL_ACCUMULATED if scenario.gas > 1 or scenario.forwards > 1 else TOL
    for step in range(scenario.steps):
        expected = reference_step(ref, ref_opt, scenario, step)
        for micro in range(scenario.gas):
            with counting() as counts:
                engine_micro_step(engine, scenario, step, micro)
            counts = dict(counts)
            if check_counts:
                want = expected_counts(engine, scenario)
                got = {k: counts.get(k, 0) for k in want}
                assert got == want, f"step {step} micro {micro}: collectives {counts}, expected {want}"
            if micro == scenario.gas - 1:
                assert_close(
                    full_grads(engine), expected, f"step {step}: grads", scenario.bf16, tol
                )
            engine.step()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close(full_params(engine), ref_params, f"step {step}: params", scenario.bf16, tol)
        assert_all_released(engine)


def assert_all_released(engine) -> None:
    for name, param in engine.module.named_parameters():
        if param.ds_persist:
            continue
        assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE, f"{name}: {param.ds_summary()}"
        assert param.data.numel() == 0, f"{name} still owns {param.data.numel()} elements"

