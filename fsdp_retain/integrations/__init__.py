"""Integrations with training frameworks, one module per framework:
``fsdp_retain.integrations.transformers`` (the transformers ``Trainer`` family: ``Trainer``,
sentence-transformers' ``SentenceTransformerTrainer``, TRL's trainers) and
``fsdp_retain.integrations.accelerate`` (accelerate's own training loop) and
``fsdp_retain.integrations.lightning`` (Lightning: which object to pass, what the DDP and
DeepSpeed backends do for its strategies). Who steps a
DeepSpeed engine and who divides by the accumulation steps under each: [Note: who steps
and who scales on DeepSpeed] in ``fsdp_retain/_deepspeed/_step.py``."""
