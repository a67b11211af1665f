"""qcollect: compressed collectives for data-parallel JAX.

Pure-function quantizers with bit-packed wire formats. Every compressor follows
one contract::

    import qcollect as qc
    c = qc.qsgd(bits=4)                # static config, validated here
    payload = c.encode(x, key)         # pytree; its array leaves are the wire
    x_hat = c.decode(payload)          # shape and dtype of x restored
    qc.payload_bytes(payload)          # bytes that travel (static)
    c.linear                           # decode(sum of payloads) == sum of decodes

This flat namespace is the public API: every name in ``__all__`` below, plus
the modules `qcollect.checks` (argument checks) and `qcollect.varying`
(shard_map's varying axes). The subpackages hold the implementation and
re-export nothing: ``coding/`` (bit-level wire formats), ``compressors/``
(the codecs and their statistics), ``collectives/`` (ring and compressed
collectives) and ``measure/`` (wire bytes and memory traffic read from the
compiled program). docs/README.md has the map of the package and its pages.

qcollect imports jax and numpy only; the optax layer is the `transforms`
package, installed by the same distribution. Importing it has no side
effects: the one exit-time check of the package (a script that runs qcollect's
collectives inside an ``srun`` or ``mpirun`` job without joining it says so
at exit) is registered the first time one of its collectives is traced
(`qcollect.launch.warn_unjoined_at_exit`).
"""

from qcollect._payload import Compressor, Payload, payload_bytes
from qcollect.coding._packing import pack_bits, packed_words, unpack_bits
from qcollect.collectives._algorithms import EXCHANGES, Exchange, collective_codec
from qcollect.collectives._blocks import block_spec_tree
from qcollect.collectives._buckets import (
    AUTO_BATCH_BYTES,
    AUTO_TRACE_LIMIT,
    BATCH_BUCKETS,
    BatchBuckets,
    runs_batched,
)
from qcollect.collectives._compressed import (
    ALGORITHMS,
    Algorithm,
    AllReduceResult,
    compressed_all_reduce,
)
from qcollect.collectives._fsdp import fsdp_gather, fsdp_residuals, shard_dimensions
from qcollect.collectives._layout import BUCKET_BYTES, leaf_chunks
from qcollect.collectives._messages import fused_psum
from qcollect.collectives._ring import (
    all_gather_invariant,
    exchange_chunks,
    permute,
    ring_all_gather,
    ring_all_reduce,
    ring_bytes_per_device,
    ring_reduce_scatter,
)
from qcollect.collectives._sharded import compressed_all_gather, compressed_reduce_scatter
from qcollect.compressors._adaptive import AdaptiveCompressor, adaptive
from qcollect.compressors._baseline import CastCompressor, cast, identity
from qcollect.compressors._dct import (
    DCTComponents,
    dct_components,
    dct_matrix,
    from_dct_components,
)
from qcollect.compressors._entropy import (
    EntropyCodec,
    EntropyCompressor,
    EntropyPlan,
    PlannedEntropyCompressor,
    entropy,
)
from qcollect.compressors._groups import matrix_view
from qcollect.compressors._onebit import OneBitCompressor, onebit
from qcollect.compressors._pca import PCACompressor, pca
from qcollect.compressors._pca_fit import PCAFit, pca_fit
from qcollect.compressors._power_iteration import (
    orthogonalize,
    powersgd_normalize,
    powersgd_p,
    powersgd_q,
    powersgd_reconstruct,
)
from qcollect.compressors._powersgd import (
    PowerSGDCompressor,
    powersgd,
    powersgd_init,
    powersgd_matrix,
    powersgd_matrix_shape,
    powersgd_rank,
    powersgd_should_compress,
)
from qcollect.compressors._qsgd import QSGD_BUCKET_SIZES, QSGDCompressor, qsgd
from qcollect.compressors._threshold import ThresholdCompressor, threshold
from qcollect.measure._phases import phase
from qcollect.measure._traffic import Kernel, memory_bytes, memory_report
from qcollect.measure._wire import (
    WireOp,
    bytes_along,
    wire_bytes,
    wire_bytes_by_axis,
    wire_bytes_by_phase,
    wire_report,
)

__all__ = [
    "ALGORITHMS",
    "AUTO_BATCH_BYTES",
    "AUTO_TRACE_LIMIT",
    "BATCH_BUCKETS",
    "BUCKET_BYTES",
    "EXCHANGES",
    "QSGD_BUCKET_SIZES",
    "AdaptiveCompressor",
    "Algorithm",
    "AllReduceResult",
    "BatchBuckets",
    "CastCompressor",
    "Compressor",
    "DCTComponents",
    "EntropyCodec",
    "EntropyCompressor",
    "EntropyPlan",
    "Exchange",
    "Kernel",
    "OneBitCompressor",
    "PCACompressor",
    "PCAFit",
    "Payload",
    "PlannedEntropyCompressor",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "ThresholdCompressor",
    "WireOp",
    "adaptive",
    "all_gather_invariant",
    "block_spec_tree",
    "bytes_along",
    "cast",
    "collective_codec",
    "compressed_all_gather",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "dct_components",
    "dct_matrix",
    "entropy",
    "exchange_chunks",
    "fsdp_gather",
    "fsdp_residuals",
    "from_dct_components",
    "fused_psum",
    "identity",
    "leaf_chunks",
    "matrix_view",
    "memory_bytes",
    "memory_report",
    "onebit",
    "orthogonalize",
    "pack_bits",
    "packed_words",
    "payload_bytes",
    "pca",
    "pca_fit",
    "permute",
    "phase",
    "powersgd",
    "powersgd_init",
    "powersgd_matrix",
    "powersgd_matrix_shape",
    "powersgd_normalize",
    "powersgd_p",
    "powersgd_q",
    "powersgd_rank",
    "powersgd_reconstruct",
    "powersgd_should_compress",
    "qsgd",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_bytes_per_device",
    "ring_reduce_scatter",
    "runs_batched",
    "shard_dimensions",
    "threshold",
    "unpack_bits",
    "wire_bytes",
    "wire_bytes_by_axis",
    "wire_bytes_by_phase",
    "wire_report",
]

__version__ = "0.1.0"

