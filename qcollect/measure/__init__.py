"""Measurements read from the compiled program: wire bytes, memory traffic, phases.

A reader of XLA's optimised HLO text, and on it the bytes each device sends
in its collectives (`qcollect.wire_bytes`, by mesh axis and by phase), the
bytes each kernel reads and writes (`qcollect.memory_bytes`), and the phase
marks a transformation puts on the branches it switches between
(`qcollect.phase`). The wire bytes every benchmark reports are measured here,
from what XLA compiled, never computed from a configuration.

This folder reads compiled programs and may import anything below it: the
core, ``coding/``, ``compressors/`` and ``collectives/``. It re-exports
nothing: the public names live in the flat ``qcollect`` namespace.
"""
