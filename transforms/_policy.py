"""Which leaves are compressed, and with which compressor.

Grubic et al. (section 3.2.2) send small matrices in full precision, choosing
the threshold so that more than 99% of the parameters are still quantized.
`leaf_choices` applies that rule (``min_size``) and an optional predicate
``compress_if(path, leaf)``, then asks a per-leaf choice of the leaves it
keeps: `leaf_compressors` a compressor (``compressor`` may be a function of the
path and leaf), `transforms.gradiveq` a slice size. `group_indices` gathers
the leaves that share a choice (a compressor, a shape), to reduce them
together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import qcollect as qc
from transforms._axes import AxisName

#: A compressor for every leaf, or ``f(path, leaf) -> Compressor | None`` per
#: leaf (None: the leaf goes uncompressed).
CompressorSpec = qc.Compressor | Callable[[Any, Any], qc.Compressor | None]

#: ``compress_if(path, leaf) -> bool``: whether a leaf may be compressed.
LeafPredicate = Callable[[Any, Any], bool]

#: How model axes shard each leaf: one ``PartitionSpec``, a pytree of them
#: like the parameters, ``f(path, leaf) -> PartitionSpec``, or None.
BlockSpecs = P | Callable[[Any, Any], P] | Any

_C = TypeVar("_C")


def leaf_choices(tree: Any, choose: Callable[[Any, Any], _C], *, min_size: int = 0,
                 compress_if: LeafPredicate | None = None) -> list[_C | None]:
    """One entry per leaf of ``tree`` (in flatten order): ``choose(path, leaf)``
    for the leaves with at least ``min_size`` values that pass ``compress_if``,
    None (uncompressed) for the others."""
    out: list[_C | None] = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        size = int(np.prod(np.shape(leaf)))
        if size < min_size or (compress_if is not None and not compress_if(path, leaf)):
            out.append(None)
        else:
            out.append(choose(path, leaf))
    return out


def leaf_compressors(tree: Any, compressor: CompressorSpec, *, min_size: int = 0,
                     compress_if: LeafPredicate | None = None) -> list[qc.Compressor | None]:
    """One entry per leaf of ``tree`` (in flatten order): a Compressor or None.

    The leaf policy of every transformation: leaves with fewer than
    ``min_size`` values, or failing ``compress_if``, go uncompressed (small
    biases cost little and lose most to quantization); the others get
    ``compressor``, or what ``compressor(path, leaf)`` chooses.

    Args:
      tree: the parameters or gradients.
      compressor: a qcollect `Compressor`, or ``f(path, leaf) -> Compressor |
        None`` (`path_name` reads the path).
      min_size: leaves with fewer values get None.
      compress_if: optional predicate ``(path, leaf) -> bool``.

    Returns:
      A list with one entry per leaf: its Compressor, or None where the leaf
      is reduced uncompressed (``lax.psum``).

    Raises:
      ValueError: ``compressor(path, leaf)`` returns something else than a
        Compressor or None.

    References:
      Grubic et al., EDBT 2018, section 3.2.2 (small matrices in full
      precision, with more than 99% of the parameters still quantized).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc, transforms
      >>> tree = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(64)}
      >>> [c is None for c in transforms.leaf_compressors(tree, qc.onebit(), min_size=1024)]
      [True, False]
    """

    def choose(path: Any, leaf: Any) -> qc.Compressor | None:
        chosen = compressor if isinstance(compressor, qc.Compressor) else compressor(path, leaf)
        if chosen is not None and not isinstance(chosen, qc.Compressor):
            raise ValueError(f"compressor(path, leaf) must return a qcollect Compressor or "
                             f"None, got {type(chosen).__name__} for {jax.tree_util.keystr(path)}")
        return chosen

    return leaf_choices(tree, choose, min_size=min_size, compress_if=compress_if)


def check_compressor(name: str, value: Any, *, per_leaf: bool = True,
                     allow_none: bool = False) -> Any:
    """``value`` if it is a qcollect Compressor, a function ``(path, leaf) ->
    Compressor | None`` (with ``per_leaf``) or None (with ``allow_none``).

    Raises:
      ValueError: anything else, naming ``name`` and what it may be.
    """
    if (isinstance(value, qc.Compressor) or (per_leaf and callable(value))
            or (allow_none and value is None)):
        return value
    kinds = ["a qcollect Compressor"]
    if per_leaf:
        kinds.append("a function (path, leaf) -> Compressor | None")
    if allow_none:
        kinds.append("None")
    allowed = " or ".join(kinds) if len(kinds) <= 2 else ", ".join(kinds[:-1]) + ", or " + kinds[-1]
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def group_indices(keys: list[_C | None]) -> dict[_C, list[int]]:
    """The positions of equal keys, ``{key: [i, ...]}`` in order of first
    appearance; None keys (uncompressed leaves) are left out."""
    groups: dict[_C, list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    return groups


def compressed_fraction(tree: Any, compressors: list[Any]) -> float:
    """Fraction of the values of ``tree`` that go through a compressor.

    Grubic et al. (section 3.2.2) choose the size threshold so that more
    than 99% of the parameters are still quantized; this measures it.

    Args:
      tree: the parameters (or gradients).
      compressors: one entry per leaf of ``tree`` in flatten order, None
        where the leaf goes uncompressed (`leaf_compressors`).

    Returns:
      The compressed leaves' share of all values, 0.0 for an empty tree.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc, transforms
      >>> tree = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(64)}
      >>> chosen = transforms.leaf_compressors(tree, qc.qsgd(bits=4), min_size=1024)
      >>> round(transforms.compressed_fraction(tree, chosen), 3)
      0.985
    """
    sizes = [int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(tree)]
    total = sum(sizes)
    kept = sum(s for s, c in zip(sizes, compressors, strict=True) if c is not None)
    return kept / total if total else 0.0


def sum_uncompressed(leaves: list[jax.Array], compressed: list[bool], axis_name: AxisName, *,
                     mean: bool, block_specs: list[P] | None = None) -> list[Any]:
    """The leaves that go uncompressed, summed (or averaged) over ``axis_name``
    in one exchange per 4 MiB bucket (`qcollect.fused_psum`, each device's
    model blocks when ``block_specs`` lists every leaf's); None in the places
    of the compressed ones, for the caller to fill."""
    plain = [i for i, c in enumerate(compressed) if not c]
    out = [None] * len(leaves)
    blocks = None if block_specs is None else [block_specs[i] for i in plain]
    summed = qc.fused_psum([leaves[i] for i in plain], axis_name, mean=mean,
                           block_specs=blocks)
    for i, v in zip(plain, summed, strict=True):
        out[i] = v
    return out


def path_name(path: tuple[Any, ...], sep: str = "/") -> str:
    """A key path as a readable name: ``"layers/0/kernel"``.

    The ``path`` a leaf policy's ``compressor(path, leaf)`` or
    ``compress_if(path, leaf)`` gets is JAX's key path of the leaf
    (``jax.tree_util.tree_leaves_with_path``): a tuple of ``DictKey`` (dicts,
    Flax linen's parameters and NNX ``State``: ``.key``), ``SequenceKey``
    (lists, tuples: ``.idx``), ``GetAttrKey`` (dataclasses, NamedTuples:
    ``.name``) and ``FlattenedIndexKey`` entries. On Flax NNX state the last
    entry is ``GetAttrKey("value")``, the ``Variable``'s value, so
    ``path[-1].key`` fails there; this joins every entry's name, without
    that trailing ``value``.

    Args:
      path: a key path, as a leaf policy receives it.
      sep: the separator between entries.

    Returns:
      The entries' names joined by ``sep``.

    Example:
      >>> import jax, jax.numpy as jnp, transforms
      >>> tree = {"layers": [{"kernel": jnp.zeros(2)}]}
      >>> [transforms.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
      ['layers/0/kernel']
    """
    names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
        names = names[:-1]
    return sep.join(names)


def matrices(*, embeddings: bool = True) -> _Matrices:
    """The rule "matrices only" for transformers, usable as a ``compress_if``
    and as an optax mask: the matrices (and kernels) are compressed or
    decayed; vectors (LayerNorm scales, biases) and scalars are not, and
    with ``embeddings=False`` neither are the leaves whose path names an
    embedding (a path entry containing ``"embed"``, any case: Flax's
    ``nn.Embed`` parameter is ``embedding``).

    Vectors are a sliver of a transformer's bytes and lose the most to
    quantization; DeepSpeed's ZeRO++ and torchft's compressed all-reduce
    send 1-D tensors uncompressed, as does PyTorch's PowerSGD hook. The same
    leaves are the ones AdamW's weight decay usually skips.
    `transforms.compressed_fraction` says what share of the values is still
    compressed.

    Args:
      embeddings: whether embedding tables count as matrices (default True).

    Returns:
      A value callable two ways: ``rule(path, leaf) -> bool``, the
      ``compress_if`` of every transformation that takes one
      (`compressed_all_reduce`, `powersgd`, `gradiveq`), and
      ``rule(params) -> pytree of bools`` (also ``rule.mask(params)``), the
      ``mask`` of ``optax.masked``, ``optax.add_decayed_weights`` and
      ``optax.adamw``. Equal settings give equal rules.

    Example:
      >>> import jax, jax.numpy as jnp, optax, transforms
      >>> params = {"embed": {"embedding": jnp.zeros((256, 64))},
      ...           "ln": {"scale": jnp.zeros(64)}, "mlp": {"kernel": jnp.zeros((64, 256))}}
      >>> keep = transforms.matrices(embeddings=False)
      >>> leaves = jax.tree_util.tree_leaves_with_path(params)
      >>> {transforms.path_name(p): keep(p, x) for p, x in leaves}
      {'embed/embedding': False, 'ln/scale': False, 'mlp/kernel': True}
      >>> keep(params)["mlp"]["kernel"], keep(params)["ln"]["scale"]
      (True, False)
      >>> tx = optax.adamw(1e-3, weight_decay=0.1, mask=transforms.matrices())
    """
    return _Matrices(embeddings=embeddings)


@dataclasses.dataclass(frozen=True)
class _Matrices:
    """`matrices`' rule: a leaf predicate and an optax mask in one value."""

    embeddings: bool = True

    def __call__(self, *args: Any) -> Any:
        if len(args) == 2:
            return self.keeps(*args)
        if len(args) == 1:
            return self.mask(args[0])
        raise TypeError(f"matrices() takes (path, leaf) or (params), got {len(args)} "
                        "arguments")

    def keeps(self, path: Any, leaf: Any) -> bool:
        """Whether ``leaf`` (at key path ``path``) counts as a matrix."""
        if np.ndim(leaf) < 2:
            return False
        return self.embeddings or not any("embed" in part.lower()
                                          for part in path_name(path).split("/"))

    def mask(self, params: Any) -> Any:
        """``params``' structure with `keeps` of each leaf: an optax mask."""
        return jax.tree_util.tree_map_with_path(self.keeps, params)
