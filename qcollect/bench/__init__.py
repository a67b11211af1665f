"""Benchmarks: ``python -m qcollect.bench BENCHMARK``.

``BENCHMARK`` is one of quantizers, collectives, network, structure, compile,
passes (memory traffic against the memory bandwidth, `qcollect.bench.passes`),
device (the codecs and a training step on this machine's accelerator against
its copy bandwidth, `qcollect.bench.device`) and training (the training gate,
`qcollect.bench.training`).

Benchmarks are scripts, not tests: they print measured tables (medians of
interleaved repetitions, so slow drifts of a shared machine hit every column
alike) and can write them as CSV/JSON. The tables they measured, each beside
the command that produced it, are in docs/benchmarks.md (its "Index" names
each benchmark's section); ``training`` is a command of a repository
checkout (`qcollect.bench.training`).
"""
