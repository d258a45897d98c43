"""What the DDP backend needs to know of PyTorch Lightning's ``DDPStrategy``, read off the
objects Lightning built (Lightning is never imported; its private
``_pl_static_graph_delay_done`` is read here, and only here). The user's side of Lightning is
``fsdp_retain/integrations/lightning.py``.

[Note: Lightning's DDPStrategy around the block]
Under ``DDPStrategy`` (Trainer, manual optimization) the LightningModule is what DDP
wraps, and ``training_step`` runs inside DDP's forward: the block opens and closes inside
it. Around every ``manual_backward`` the strategy reaches into DDP's reducer:

- ``pre_backward`` arms the reducer (``prepare_for_backward``, which also sets
  ``require_forward_param_sync``) when ``require_backward_grad_sync`` is set. In the block
  it is off, so nothing is armed and the block reduces. (That re-arming is also why plain
  manual optimization is right under DDPStrategy: every ``manual_backward`` is reduced.)
- ``post_backward``, after the first ``manual_backward`` of the run with
  ``static_graph=True``, flushes DDP's first iteration itself (the reducer's delayed
  all-reduce; DDP's own output hook never runs, since ``training_step`` returns no tensor
  through DDP's forward). That first iteration is where DDP learns its static graph:
  which parameters each pass uses, counted by the reducer's hooks while armed.

The first step of the run is DDP's first iteration even when the block runs it (DDP's
forward, around ``training_step``, counted it before the block opened). Were the reducer
left unarmed there, Lightning's flush would fail on torch's internal assert after the
pass wrote its gradients, and with the flush held off DDP would learn an empty graph: a
later step outside a block would then be silently wrong. So until Lightning has flushed
(its ``_pl_static_graph_delay_done``), the block leaves ``require_backward_grad_sync`` on:
Lightning arms the reducer for the first ``manual_backward`` and flushes it after the
pass, as in a plain run. The block sees the reducer armed as that pass starts (Lightning
set ``require_forward_param_sync``, which the block cleared) and turns the sync off from
there. That pass's gradients are all-reduced twice, by the block and by DDP's flush: the
average of equal tensors is the same tensor (to rounding). A pass Lightning did not arm
(``loss.backward()``, ``block.backward``) leaves the sync on for the next one.
"""

from __future__ import annotations

from typing import Any

_FLUSHED = "_pl_static_graph_delay_done"  # Lightning 2.6's DDPStrategy


def static_graph_unlearned(ddp: Any) -> bool:
    """Whether Lightning's ``DDPStrategy`` drives ``ddp`` with ``static_graph=True`` and has
    not yet flushed DDP's first iteration: see [Note: Lightning's DDPStrategy around the
    block]. False for a DDP no Lightning strategy drives, and under a Lightning that does
    not flush it (no such record)."""
    if not getattr(ddp, "static_graph", False):
        return False
    strategy = _strategy_of(getattr(ddp, "module", None))
    if strategy is None or getattr(strategy, "model", None) is not ddp:
        return False
    return getattr(strategy, _FLUSHED, True) is False


def _strategy_of(module: Any) -> Any:
    """The strategy of the Trainer a LightningModule is attached to, or ``None``."""
    if not any(cls.__name__ == "LightningModule"
               and cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
               for cls in type(module).__mro__):
        return None
    return getattr(getattr(module, "_trainer", None), "strategy", None)
