"""Integrations with training frameworks: ``fsdp_retain.integrations.transformers`` (the
transformers ``Trainer`` family: ``Trainer``, sentence-transformers'
``SentenceTransformerTrainer``, TRL's trainers)."""
