"""transforms: optax GradientTransformations built on qcollect's public API.

Installed by the qcollect distribution (``pip install "qcollect[optax]"``).
"""

from transforms._allreduce import CompressedAllReduceState, compressed_allreduce
from transforms._averaging import ModelAveragingState, compressed_model_averaging
from transforms._gradiveq import GradiVeQState, gradiveq
from transforms._policy import compressed_fraction, leaf_compressors
from transforms._powersgd import PowerSGDState, powersgd
from transforms._sharding import first, local, replicate, unlocal

__all__ = [
    "CompressedAllReduceState",
    "GradiVeQState",
    "ModelAveragingState",
    "PowerSGDState",
    "compressed_allreduce",
    "compressed_fraction",
    "compressed_model_averaging",
    "first",
    "gradiveq",
    "leaf_compressors",
    "local",
    "powersgd",
    "replicate",
    "unlocal",
]
