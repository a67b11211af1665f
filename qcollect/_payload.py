"""The compressor contract: `Payload`, `Compressor` and `payload_bytes`.

A compressor is a static configuration plus two pure functions. Its encode
returns a `Payload`: a pytree whose array leaves are exactly the words that
would travel on the wire, while the original shape, dtype and the wire-format
name ride along as static aux data. Because the metadata is static, a payload
passes through `jax.jit`, `jax.vmap`, `jax.lax.ppermute` and `jax.lax.cond`
like any other pytree, and no output shape ever depends on data.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import jax
import numpy as np

#: The groups a compressor computes its statistics over (`Compressor.grouping`).
GROUPINGS = ("element", "bucket", "column", "leaf")
Grouping = Literal["element", "bucket", "column", "leaf"]


__all__ = ["Compressor", "Payload", "payload_bytes"]


@dataclasses.dataclass(frozen=True)
class Payload:
    """What one compressor sends for one array.

    Attributes:
      arrays: the wire words, a dict of named arrays (packed codes, scales,
        means...). These are the only pytree leaves.
      shape: static shape of the encoded array.
      dtype: static dtype of the encoded array; decode returns it.
      format: static wire-format name, e.g. ``"qsgd/b4/512/max"``. Decoding a
        payload with a compressor of another format raises ValueError.
    """

    arrays: dict[str, Any]
    shape: tuple[int, ...]
    dtype: Any
    format: str

    def __getitem__(self, name: str) -> jax.Array:
        """The wire array ``name``: ``payload["codes"]`` is ``payload.arrays["codes"]``."""
        return self.arrays[name]


jax.tree_util.register_dataclass(
    Payload, data_fields=["arrays"], meta_fields=["shape", "dtype", "format"]
)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Compressor:
    """A compressor: a value holding static settings and pure encode/decode functions.

    Compressors are values: two built with the same settings are equal and
    hash alike (``qc.qsgd(bits=4) == qc.qsgd(bits=4)``), so they serve as
    dict keys, as static arguments of `jax.jit` (equal compressors share one
    compiled program) and as fusion groups (`transforms` lets leaves with
    equal compressors share collectives). Equality compares the type, the
    wire-format name, the flags below and the factory's settings; ``encode``
    and ``decode`` are derived from those and are not compared. Settings
    that are arrays (PCA's basis and mean, PowerSGD's factor) compare by
    object identity: equal values in two different arrays make two different
    compressors, and nothing is ever traced or hashed by value.

    Settings are recorded as validated and resolved, so equal behaviour
    means equal settings: ``qc.qsgd(bits=4)`` equals
    ``qc.qsgd(bits=4, bucket_size=512)`` and ``qc.cast(jnp.bfloat16)`` equals
    ``qc.cast("bfloat16")``. Scalars compare with their kind (``1``, ``1.0``
    and ``True`` are three different settings).

    Each factory returns a subclass whose settings are typed dataclass
    fields (`QSGDCompressor`'s ``bits``, ``bucket_size``, ``norm``...), so
    they read as attributes that type checkers see:
    ``qc.qsgd(bits=4).bits == 4``, ``qc.qsgd(bits=4).bucket_size == 512``.
    ``settings`` lists them as ``(name, value)`` pairs in the factory's
    argument order (a subclass names them in ``setting_names``). The repr
    is the factory call with every setting spelled out.

    Attributes:
      name: wire-format name shared by every payload it produces.
      encode: ``encode(x, key=None) -> Payload``. Stochastic compressors need a
        PRNG key and raise ValueError without one.
      decode: ``decode(payload) -> x_hat`` with the shape and dtype of ``x``.
      linear: True when ``decode(sum of payloads) == sum of decodes``, so
        payloads may be summed in the compressed domain.
      stochastic: True when encode consumes ``key``.
      block: values per bucket when ``grouping == "bucket"`` (QSGD and 1-bit
        buckets, PCA slices); 1 otherwise.
      grouping: the groups its statistics (scales, means, thresholds, ranges)
        are computed over, within one array: ``"element"`` (none: identity,
        cast, threshold), ``"bucket"`` (runs of ``block`` consecutive values,
        flattened row-major), ``"column"`` (columns of the array's matrix
        view, `qcollect.matrix_view`) or ``"leaf"`` (the whole array).
        `compressed_all_reduce` lays leaves out so that no group spans two
        leaves or two devices (see `qcollect.leaf_chunks` and
        docs/collectives.md#per-layer-groups-through-the-collective).
      masks_padding: True when ``encode`` takes ``valid=``, an int32 array
        with one count per group: the group's first ``valid[g]`` values are
        real and the rest is zero padding that must not enter its statistics
        (1-bit means, adaptive selections, entropy ranges). Collectives pass
        it for a leaf's last, partial bucket and for padding chunks.
      settings: the factory's settings as ``(name, value)`` pairs, in the
        factory's argument order; derived from the fields ``setting_names``
        lists where a subclass declares them.
      encode_decoded: optional ``encode_decoded(x, key=None, **kw) ->
        (payload, x_hat)`` with ``x_hat == decode(payload)``, computed in
        the encoding pass from the values the codes were made of (no
        unpacking): what `round_trip` runs when the format allows it.
      variant: optional ``variant(format) -> Compressor | None``: for a
        compressor whose payloads come in variants of its format with other
        sizes (an entropy plan), the compressor that encodes payloads of
        ``format``, against whose layout decoding checks them; None for a
        format that is no variant.

    Decoding validates the payload first, at trace time (nothing runs on
    the device): its format must be ``name``, and its array leaves must be
    exactly those ``encode`` makes for an array of the payload's static
    shape and dtype (the same names, shapes and dtypes), or ValueError
    names the leaf, its shape and dtype, and the ones expected. A
    truncated scale or code array therefore fails loudly instead of
    decoding to wrong values. The expected leaves are
    `jax.eval_shape` of ``encode`` (trace only), kept per shape and dtype
    on the compressor, so a program pays for them once per compressor and
    array shape. Under `jax.vmap` the leaves are compared with their
    per-example shapes; payloads summed in the compressed domain and
    payloads encoded with ``valid=`` have the plain layout. Payloads whose
    sizes a static plan sets (`entropy`'s ``with_plan``) name the plan in
    their format, so they are checked exactly against that plan's layout
    (``variant``).

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> c = qc.qsgd(bits=4)
      >>> c == qc.qsgd(bits=4), c == qc.qsgd(bits=8), c.bits, c.bucket_size
      (True, False, 4, 512)
      >>> {c: "fused"}[qc.qsgd(bits=4)]
      'fused'
      >>> c
      qsgd(bits=4, bucket_size=512, norm='max', stochastic=True)
      >>> p = c.encode(jnp.ones(1000), jax.random.key(0))
      >>> c.decode(p).shape, qc.payload_bytes(p)
      ((1000,), 508)
    """

    name: str
    encode: Callable[..., Payload] = dataclasses.field(compare=False)
    decode: Callable[[Payload], jax.Array] = dataclasses.field(compare=False)
    linear: bool
    stochastic: bool
    block: int = 1
    grouping: Grouping = "element"
    masks_padding: bool = False
    settings: tuple[tuple[str, Any], ...] = ()
    encode_decoded: Callable[..., tuple[Payload, jax.Array]] | None = dataclasses.field(
        default=None, compare=False)
    variant: Callable[[str], Compressor | None] | None = dataclasses.field(
        default=None, compare=False)

    #: The fields that are the factory's settings, in its argument order.
    setting_names: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.setting_names:
            object.__setattr__(self, "settings",
                               tuple((k, getattr(self, k)) for k in self.setting_names))
        # Decode through the layout check; a decode taken from another
        # compressor (``dataclasses.replace``, a shared codec) is unwrapped
        # first, so it is checked against this compressor's own encode.
        decode = getattr(self.decode, _UNCHECKED, self.decode)
        object.__setattr__(self, "_layouts", {})
        object.__setattr__(self, "decode", _checked_decode(self, decode))

    def _layout(self, shape: tuple[int, ...], dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
        """``{leaf name: jax.ShapeDtypeStruct}`` that ``encode`` makes for an
        array of ``shape`` and ``dtype`` (nested names joined by ``/``).

        `jax.eval_shape` of ``encode`` (with a key where stochastic): trace
        only, computed once per shape and dtype and kept on the compressor.
        Raises ValueError when ``encode`` rejects such an array.
        """
        spec = (tuple(int(d) for d in shape), np.dtype(dtype))
        layouts = object.__getattribute__(self, "_layouts")
        if spec not in layouts:
            layouts[spec] = _eval_layout(self, *spec)
        return dict(layouts[spec])

    def round_trip(self, x: jax.Array, key: jax.Array | None = None,
                   **kwargs: Any) -> tuple[Payload, jax.Array]:
        """``(payload, decode(payload))`` of ``x``: the error-feedback round trip.

        Error feedback keeps ``x - decode(encode(x))``. Compressors whose
        decoded values follow from the encoding pass's own intermediates
        (1-bit: each value's side mean; QSGD: each level times its step)
        return them from that pass, so one program reads ``x`` once instead
        of encoding, then unpacking the codes it just packed. Others encode,
        then decode. Either way ``x_hat`` equals ``decode(payload)`` bit for
        bit. ``kwargs`` go to ``encode`` (``valid=`` where
        ``masks_padding``).

        Args:
          x: the floating-point array to compress.
          key: a PRNG key, needed where ``stochastic``.
          **kwargs: passed to ``encode`` (``valid=`` where ``masks_padding``).

        Returns:
          ``(payload, x_hat)`` with ``x_hat == decode(payload)``.

        Example:
          >>> import jax.numpy as jnp, qcollect as qc
          >>> c = qc.onebit(bucket_size=4)
          >>> payload, x_hat = c.round_trip(jnp.array([1., 3., -2., -4.]))
          >>> x_hat
          Array([ 2.,  2., -3., -3.], dtype=float32)
        """
        if self.encode_decoded is not None:
            return self.encode_decoded(x, key, **kwargs)
        payload = self.encode(x, key, **kwargs)
        return payload, self.decode(payload)

    def _identity(self) -> tuple[Any, ...]:
        return (type(self), self.name, self.linear, self.stochastic, self.block,
                self.grouping, self.masks_padding,
                tuple((k, _comparable(v)) for k, v in self.settings))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Compressor):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        factory = self.name.split("/")[0]
        args = ", ".join(f"{k}={_short_repr(v)}" for k, v in self.settings)
        return f"{factory}({args})"


def _comparable(value: Any) -> Any:
    """The hashable stand-in of one setting.

    Scalars and strings compare by kind and value; tuples, lists and dicts
    element by element; arrays (concrete or traced, never hashable by value)
    and other unhashable objects by identity. The compressor keeps a
    reference to every setting, so an identity is never reused while the
    compressor lives.
    """
    if isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "aval"):
        return ("array", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_comparable(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, _comparable(v)) for k, v in value.items())))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return (type(value), value)


def _short_repr(value: Any) -> str:
    if isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "aval"):
        return f"<array {tuple(value.shape)} {value.dtype}>"
    if isinstance(value, type) or callable(value) and hasattr(value, "__name__"):
        return getattr(value, "__name__", repr(value))
    return repr(value)


def payload_bytes(tree: Any) -> int:
    """Bytes in the array leaves of a payload (or of any pytree of payloads).

    Static: it reads shapes and dtypes only, so it works on concrete arrays,
    tracers and `jax.ShapeDtypeStruct` trees from `jax.eval_shape`, and a
    program's size on the wire is known before it runs. Under `jax.vmap` it
    counts one example. What a compiled collective really sends is
    `qcollect.wire_bytes`.

    Args:
      tree: a `Payload`, or any pytree whose leaves have ``shape`` and
        ``dtype``.

    Returns:
      The sum over the leaves of ``size * itemsize``, a Python int.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> qc.payload_bytes(jax.eval_shape(qc.onebit().encode, jnp.zeros(640)))
      160
    """
    return int(
        sum(
            int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
            for leaf in jax.tree_util.tree_leaves(tree)
        )
    )


def check_format(payload: Payload, name: str) -> None:
    """Raises ValueError, naming both formats, when ``payload`` was made by
    another wire format than ``name``."""
    if not isinstance(payload, Payload):
        raise TypeError(f"payload must be a qcollect Payload, got {type(payload).__name__}")
    if payload.format != name:
        raise ValueError(f"payload has wire format {payload.format!r}, but this compressor "
                         f"decodes format {name!r}; decode it with the compressor that "
                         "encoded it")


#: Attribute of a checked decode holding the compressor's own decode.
_UNCHECKED = "_qcollect_unchecked_decode"


def _checked_decode(compressor: Compressor,
                    decode: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``decode`` behind `check_payload` for ``compressor``."""

    @functools.wraps(decode)
    def checked(payload: Payload, *args: Any, **kwargs: Any) -> jax.Array:
        check_payload(compressor, payload)
        return decode(payload, *args, **kwargs)

    setattr(checked, _UNCHECKED, decode)
    return checked


def _leaf_name(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def _leaves(arrays: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of a payload's array leaves (arrays, tracers
    or `jax.ShapeDtypeStruct`)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(arrays)
    out = {}
    for path, leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            out[_leaf_name(path)] = (tuple(leaf.shape), np.dtype(leaf.dtype))
        else:
            out[_leaf_name(path)] = (np.shape(leaf), np.result_type(leaf))
    return out


def _eval_layout(compressor: Compressor, shape: tuple[int, ...],
                 dtype: np.dtype) -> tuple[tuple[str, jax.ShapeDtypeStruct], ...]:
    """The leaves of ``compressor.encode`` for ``shape`` and ``dtype``, traced
    abstractly, as ``((name, ShapeDtypeStruct), ...)``."""

    def encode(x: jax.Array) -> Payload:
        if compressor.stochastic:
            return compressor.encode(x, jax.random.key(0))
        return compressor.encode(x)

    try:
        payload = jax.eval_shape(encode, jax.ShapeDtypeStruct(shape, dtype))
    except (ValueError, TypeError) as err:
        raise ValueError(f"a {compressor.name!r} payload cannot hold a {shape} {dtype} "
                         f"array: its encode rejects one ({err})") from err
    return tuple((name, jax.ShapeDtypeStruct(s, d))
                 for name, (s, d) in _leaves(payload.arrays).items())


def check_payload(compressor: Compressor, payload: Payload) -> None:
    """Raises ValueError unless ``payload`` is one ``compressor`` encodes.

    Trace-time only: compares the format name, then the payload's leaf
    names, shapes and dtypes with the layout ``encode`` makes for its static shape
    and dtype. `Compressor.decode` runs it before decoding.

    Raises:
      TypeError: ``payload`` is not a `Payload`.
      ValueError: another format, a missing or extra leaf, or a leaf of
        another shape or dtype; the message names the leaf and both.
    """
    if payload.format != compressor.name and compressor.variant is not None:
        variant = compressor.variant(payload.format)
        if variant is not None:
            compressor = variant
    check_format(payload, compressor.name)
    want = {name: (tuple(s.shape), np.dtype(s.dtype))
            for name, s in compressor._layout(payload.shape, payload.dtype).items()}
    got = _leaves(payload.arrays)
    what = (f"a {payload.format!r} payload of a {tuple(payload.shape)} "
            f"{np.dtype(payload.dtype).name} array")
    if got.keys() != want.keys():
        missing = sorted(want.keys() - got.keys())
        extra = sorted(got.keys() - want.keys())
        raise ValueError(f"payload leaves {sorted(got)} are not those of {what}: "
                         f"{sorted(want)} (missing {missing}, unexpected {extra})")
    for name, (shape, dtype) in got.items():
        want_shape, want_dtype = want[name]
        if dtype == want_dtype and shape == want_shape:
            continue
        raise ValueError(f"payload leaf {name!r} has shape {shape} and dtype {dtype.name}, "
                         f"but {what} has {name!r} of shape {want_shape} and dtype "
                         f"{want_dtype.name}")
