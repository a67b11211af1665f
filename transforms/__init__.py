"""transforms: optax GradientTransformations built on qcollect's public API.

Installed by the qcollect distribution (``pip install "qcollect[optax]"``).

Every transformation takes the data axis first, positionally, and every
setting by keyword: ``compressed_all_reduce("data", compressor=..., key=...)``.
Parameters and optimizer moments stay replicated (``P()``); only error-feedback
residuals are per device (`state_specs`, `init_sharded`). docs/transforms.md
is the guide, with a training step for each transformation.
"""

import qcollect as _qcollect

# Importable from here but not in ``__all__``: the types of
# ``compressed_all_reduce``'s ``state.feedback`` (``transforms.ResidualState``,
# ``transforms.EF21State``) and of what ``diloco_schedule`` returns, reached
# through those values; and the deprecated ``powersgd_phases`` and
# ``warm_up_phases`` (``transforms.CompressAfter(K).spans(steps)``).

if getattr(_qcollect, "__file__", None) is None:  # a folder, not the package
    raise ImportError(
        f"'import qcollect' found the folder {', '.join(_qcollect.__path__)}, not the "
        "installed package: a folder named qcollect in the current directory (or on "
        "PYTHONPATH) shadows an editable install. Run from another directory, or rename "
        "the folder.")

from transforms._accumulate import AccumulateState, accumulate
from transforms._all_reduce import CompressedAllReduceState, compressed_all_reduce
from transforms._averaging import ModelAveragingState, compressed_model_averaging
from transforms._blocks import local_replica
from transforms._checkpoint import restore_sharded
from transforms._demo import DeMoState, decoupled_momentum
from transforms._diloco import DiLoCoState, diloco
from transforms._diloco_schedule import DiLoCoStep, diloco_schedule, fragment_masks
from transforms._ef21 import EF21State
from transforms._feedback import ef21, residual_feedback
from transforms._finite import apply_if_finite
from transforms._frozen_adam import FrozenAdamState, frozen_adamw, scale_by_frozen_adam
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
from transforms._gradiveq_cycle import gradiveq_phases
from transforms._mean import mean_all_reduce
from transforms._onebit_adam import OneBitAdamState, onebit_adam
from transforms._phases import (
    CompressAfter,
    PhaseSpan,
    powersgd_phases,
    steps_per_phase,
    warm_up_phases,
)
from transforms._placement import init_sharded, state_specs
from transforms._policy import compressed_fraction, leaf_compressors, matrices, path_name
from transforms._powersgd import PowerSGDState, powersgd
from transforms._residual import ResidualState
from transforms._zero_one_adam import ZeroOneAdamState, zero_one_adam
from transforms._zero_one_schedule import ZeroOneSchedule

__all__ = [
    "FSDP",
    "AccumulateState",
    "CompressAfter",
    "CompressedAllReduceState",
    "DeMoState",
    "DiLoCoState",
    "FSDPState",
    "FrozenAdamState",
    "GradiVeQState",
    "ModelAveragingState",
    "OneBitAdamState",
    "PhaseSpan",
    "PowerSGDState",
    "ZeroOneAdamState",
    "ZeroOneSchedule",
    "accumulate",
    "apply_if_finite",
    "clip_by_global_norm",
    "compressed_all_reduce",
    "compressed_fraction",
    "compressed_model_averaging",
    "decoupled_momentum",
    "diloco",
    "diloco_schedule",
    "ef21",
    "fragment_masks",
    "frozen_adamw",
    "fsdp",
    "gradiveq",
    "gradiveq_phases",
    "init_on_shards",
    "init_sharded",
    "leaf_compressors",
    "local_replica",
    "matrices",
    "mean_all_reduce",
    "onebit_adam",
    "path_name",
    "powersgd",
    "residual_feedback",
    "restore_sharded",
    "scale_by_frozen_adam",
    "shard_params",
    "shard_specs",
    "sharded_specs",
    "state_specs",
    "steps_per_phase",
    "zero_one_adam",
]
