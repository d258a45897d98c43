"""The walks a block runs at every entry, without ranks: ``module_parameters`` (ZeRO's
parameter lists) is ``list(module.parameters())``, order and identity, and
``tree_signature`` (whether the hooks kept on a DDP or ZeRO-0/1/2 model still fit it)
changes with the module tree and with a module compiled in place."""

import torch.nn as nn

from fsdp_retain._common import module_parameters
from fsdp_retain._kept_hooks import tree_signature


def _model() -> nn.Module:
    shared = nn.Linear(3, 3)
    head = nn.Linear(3, 5, bias=False)  # a None parameter
    model = nn.Sequential(
        nn.Embedding(5, 3),
        nn.Sequential(shared, nn.Tanh(), nn.LayerNorm(3)),
        nn.ModuleDict({"again": shared, "norm": nn.LayerNorm(3)}),  # a module seen twice
        head,
    )
    model.register_module("absent", None)  # a None child
    head.weight = model[0].weight  # a parameter tied across modules
    return model


def test_module_parameters_is_parameters():
    model = _model()
    want = list(model.parameters())
    got = module_parameters(model)
    assert len(got) == len(want) == 7
    assert all(a is b for a, b in zip(got, want))
    assert module_parameters(model[1]) == list(model[1].parameters())


def test_tree_signature_follows_the_tree():
    model = _model()
    before = tree_signature(model)
    assert tree_signature(model) == before
    model[1][1] = nn.ReLU()  # a module replaced
    replaced = tree_signature(model)
    assert replaced != before
    model[2]["norm"].compile()  # compiled in place: same modules, a flag flips
    compiled = tree_signature(model)
    assert len(compiled) == len(replaced) and compiled != replaced
