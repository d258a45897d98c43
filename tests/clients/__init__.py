"""Real client libraries, each in its own venv where it needs one: bergson, sentence-
transformers, OLMo-core, and the transformers integration."""
