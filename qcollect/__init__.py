"""qcollect: compressed collectives for data-parallel JAX.

Pure-function quantizers with bit-packed wire formats. Every compressor follows
one contract::

    import qcollect as qc
    c = qc.qsgd(bits=4)                # static config, validated here
    payload = c.encode(x, key)         # pytree; its array leaves are the wire
    x_hat = c.decode(payload)          # shape and dtype of x restored
    qc.payload_bytes(payload)          # bytes that travel (static)
    c.linear                           # decode(sum of payloads) == sum of decodes

qcollect imports jax and numpy only; the optax layer is the `transforms`
package, installed by the same distribution.
"""

from qcollect._baseline import cast, identity
from qcollect._onebit import onebit
from qcollect._packing import pack_bits, packed_words, unpack_bits
from qcollect._payload import Compressor, Payload, payload_bytes
from qcollect._qsgd import QSGD_BUCKET_SIZES, qsgd

__all__ = [
    "Compressor",
    "Payload",
    "QSGD_BUCKET_SIZES",
    "cast",
    "identity",
    "onebit",
    "pack_bits",
    "packed_words",
    "payload_bytes",
    "qsgd",
    "unpack_bits",
]

__version__ = "0.1.0"
