"""transforms: optax GradientTransformations built on qcollect's public API.

Installed by the qcollect distribution (``pip install "qcollect[optax]"``).

Every transformation takes the data axis first, positionally, and every
setting by keyword: ``compressed_all_reduce("data", compressor=..., key=...)``.
Parameters and optimizer moments stay replicated (``P()``); only error-feedback
residuals are per device (`state_specs`, `init_sharded`).
"""

from transforms._all_reduce import CompressedAllReduceState, compressed_all_reduce
from transforms._averaging import ModelAveragingState, compressed_model_averaging
from transforms._checkpoint import restore_sharded
from transforms._diloco import DiLoCoState, diloco, fragment_masks
from transforms._fsdp import (
    FSDP,
    FSDPState,
    clip_by_global_norm,
    fsdp,
    init_on_shards,
    shard_params,
    shard_specs,
    sharded_specs,
)
from transforms._gradiveq import GradiVeQState, gradiveq
from transforms._policy import compressed_fraction, leaf_compressors
from transforms._powersgd import PowerSGDState, powersgd
from transforms._sharding import init_sharded, state_specs

__all__ = [
    "FSDP",
    "CompressedAllReduceState",
    "DiLoCoState",
    "FSDPState",
    "GradiVeQState",
    "ModelAveragingState",
    "PowerSGDState",
    "clip_by_global_norm",
    "compressed_all_reduce",
    "compressed_fraction",
    "compressed_model_averaging",
    "diloco",
    "fragment_masks",
    "fsdp",
    "gradiveq",
    "init_on_shards",
    "init_sharded",
    "leaf_compressors",
    "powersgd",
    "restore_sharded",
    "shard_params",
    "shard_specs",
    "sharded_specs",
    "state_specs",
]
