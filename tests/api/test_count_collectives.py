"""``fsdp_retain._measure.count_collectives`` (the report's and the example tests' counter)
with modules whose forward runs more than once in one block: a module called per layer (as
transformers 5.25's shared ``apply_rotary_pos_emb`` module is), a second forward of the
model, a checkpoint's recomputation, and a tiny transformers Qwen2. torch's
``CommDebugMode`` alone raises ``IndexError`` on the first two (see [Note: a module that
runs its forward more than once under CommDebugMode]). One process, torch's fake process
group (world size 2): its collectives dispatch as real ones do, and no gloo thread is made.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp_retain._measure import count_collectives


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Reduced(nn.Module):
    """Scales by a parameter and all-reduces: one collective per call."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = x * self.scale
        dist.all_reduce(y)
        return y


class Layer(nn.Module):
    def __init__(self, shared: Reduced) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.shared = [shared]  # not a submodule: one module run by every layer

    def forward(self, x):
        return self.shared[0](self.linear(x))


class Model(nn.Module):
    """3 layers, each running the one ``Reduced`` outside the model (as transformers' module-level
    rotary one is): 3 all-reduces per forward."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        shared = Reduced()
        self.layers = nn.ModuleList(Layer(shared) for _ in range(3))
        self.checkpointed = checkpointed

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return x


def _forward_hooks() -> int:
    return sum(len(m._forward_hooks) for m in gc.get_objects() if isinstance(m, nn.Module))


def _step(model: nn.Module, forwards: int) -> None:
    for _ in range(forwards):
        model(torch.ones(2, 4)).sum().backward()


@pytest.mark.parametrize("forwards", [1, 2])
def test_a_module_run_per_layer_and_a_second_forward(fake_group, forwards):
    """3 all-reduces per forward, for one forward and for two forwards in one block, twice;
    the block leaves no forward hook behind; and torch's own CommDebugMode raises
    IndexError on the same step (of another model: it leaves hooks on this one's)."""
    from torch.distributed.tensor.debug import CommDebugMode

    model, hooks = Model(), _forward_hooks()
    for _ in range(2):  # a second block after the first: nothing left over from it
        with count_collectives() as counts:
            _step(model, forwards)
        assert (counts.all_reduce, counts.all_gather, counts.reduce_scatter) == (3 * forwards, 0, 0)
        assert _forward_hooks() == hooks
    with pytest.raises(IndexError):
        with CommDebugMode():
            _step(Model(), forwards)


def test_recomputed_in_backward(fake_group):
    """Non-reentrant checkpointing runs each layer's forward again in backward, the shared
    module's included (its recomputation stops at the product backward needs, before the
    all-reduce): 3 per forward, as the plain dispatch mode counts them."""
    model = Model(checkpointed=True)
    with count_collectives() as counts:
        _step(model, 2)
    assert counts.all_reduce == 2 * 3
    with count_collectives(modules=False) as tally:  # the plain dispatch mode agrees
        _step(model, 2)
    assert tally.all_reduce == counts.all_reduce


def test_transformers_qwen2_two_forwards(fake_group):
    """A tiny transformers Qwen2 (5.25 and later run one rotary module in every layer),
    two forwards and backwards in one block: counted, nothing collective, nothing raised."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    model, hooks = transformers.Qwen2ForCausalLM(config), _forward_hooks()
    ids = torch.randint(0, 64, (2, 8))
    with count_collectives() as counts:
        for _ in range(2):
            model(input_ids=ids).logits.sum().backward()
    assert counts.by_op == {}
    assert _forward_hooks() == hooks
