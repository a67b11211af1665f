"""A byte-level GPT on Python's standard library, data-parallel with compressed all-reduce."""
