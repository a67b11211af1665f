"""The codecs and their statistics: what each compressor computes and sends.

Each compressor is a factory that returns a `qcollect.Compressor` value with
pure ``encode`` and ``decode``: the baselines (``identity``, ``cast``),
Seide's 1-bit quantization, QSGD, Strom's threshold quantization, Dryden's
adaptive quantization, Oland & Raj's entropy coding, GradiVeQ's PCA with its
fit, and PowerSGD with its power iteration; beside them the statistics they
share (groups of buckets or columns, overflow-safe power-of-two scaling, a
counter-based generator for stochastic rounding). docs/compressors.md
describes each one and its wire format.

This folder imports the core and ``coding/`` (the bit formats), never
``collectives/`` or ``measure/``: a codec does not know how it travels. It
re-exports nothing: the public names (`qcollect.qsgd`, `qcollect.onebit`,
...) live in the flat ``qcollect`` namespace.
"""
