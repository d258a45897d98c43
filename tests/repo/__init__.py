"""The repository's own rules and tools: package layout, the CI subset, the GPU validation kit."""
