"""PyTorch Lightning with ``no_reshard_between_backwards``: nothing to call here. In a
``LightningModule`` with manual optimization the block takes
``self.trainer.strategy.model`` (the DDP or FSDP1 root, or the DeepSpeed engine); with
Fabric, the module ``fabric.setup`` returned (your own module is refused, naming it:
``fsdp_retain/_stack.py``). docs/integrations/lightning.md says what each strategy gives,
plain and in the block.

What the block does for Lightning's seams: under ``DDPStrategy`` with ``static_graph=True``
it leaves DDP's first static-graph iteration to Lightning in the run's first step
([Note: Lightning's DDPStrategy around the block] in ``fsdp_retain/_ddp/_lightning.py``);
under ``DeepSpeedStrategy`` ``manual_backward`` is ``engine.backward`` and ``opt.step()`` is
``engine.step()``, after the block ([Note: who steps and who scales on DeepSpeed] in
``fsdp_retain/_deepspeed/_step.py``).
"""

__all__: list[str] = []
