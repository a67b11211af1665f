"""Shared pieces of the MNIST examples: data, configuration, compressors,
data-parallel training and reports. The examples put ``examples/`` on
``sys.path`` and import this as ``common``."""
