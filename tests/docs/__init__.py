"""The README, docs/ and examples/: links, quoted figures, the examples run end to end."""
