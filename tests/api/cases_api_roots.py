"""A pass whose root is a unit's own output (part of ``tests/api/cases_api.py``).

``out.backward(gradient=g)`` on what an FSDP unit returned makes that output's node
the root of a single-root backward, and autograd leaves such a root out of the nodes
it reports as executing (``torch._C._will_engine_execute_node`` is False for it).
The block must still see that the pass reaches the unit: with a forward from before
the block still holding its graph, FSDP1 refused the pass as running over that older
forward (``FORWARD_OUTSIDE``). Single-unit models (the root only), FSDP1 flat and
original parameters, FSDP2, every option; the gradients equal the reference's.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import assert_close_dicts, averaged_grads, batch

registry = Registry()


def _root_output_case(flavour: str, keep: bool, sync: str) -> None:
    torch.manual_seed(42)
    net = nn.Linear(12, 12)
    ref = copy.deepcopy(net)
    if flavour == "fsdp2":
        model, adapter = fully_shard(net), f2.ADAPTER
    else:
        uop = flavour == "fsdp1_orig"
        model = FSDP(net, use_orig_params=uop, device_id=torch.device("cpu"))
        adapter = f1.ADAPTER
    x = batch(0)
    before = model(x)  # a forward before the block, its graph still held
    g = torch.linspace(-1.0, 1.0, 12).expand(x.shape[0], 12)
    with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync) as b:
        out = model(x)
        out.backward(g, retain_graph=True)
        out.backward(2 * g)
        assert b.backward_passes == 2, b.backward_passes
    out_ref = ref(x)
    out_ref.backward(3 * g)
    assert_close_dicts(adapter.full_grads(model), averaged_grads(ref), "grads")
    del before


for _flavour, (_keep, _sync) in itertools.product(
    ("fsdp1_flat", "fsdp1_orig", "fsdp2"), ((True, "every"), (False, "every"), (True, "last"))
):
    registry.add(
        f"root_output_pass_{_flavour}_{'keep' if _keep else 'regather'}_{_sync}",
        lambda f=_flavour, k=_keep, s=_sync: _root_output_case(f, k, s),
    )
