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

from collections.abc import Callable

import jax
import numpy as np

import qcollect as qc

CompressorSpec = qc.Compressor | Callable[..., qc.Compressor | None]


def leaf_choices(tree, choose: Callable, *, min_size: int = 0,
                 compress_if: Callable | None = None) -> list:
    """One entry per leaf of ``tree`` (in flatten order): ``choose(path, leaf)``
    for the leaves with at least ``min_size`` values that pass ``compress_if``,
    None (uncompressed) for the others."""
    out: list = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        size = int(np.prod(np.shape(leaf)))
        if size < min_size or (compress_if is not None and not compress_if(path, leaf)):
            out.append(None)
        else:
            out.append(choose(path, leaf))
    return out


def leaf_compressors(tree, compressor: CompressorSpec, *, min_size: int = 0,
                     compress_if: Callable | None = None) -> list:
    """One entry per leaf of ``tree`` (in flatten order): a Compressor or None.

    None means the leaf is reduced uncompressed (``lax.psum``).
    """

    def choose(path, leaf):
        chosen = compressor if isinstance(compressor, qc.Compressor) else compressor(path, leaf)
        if chosen is not None and not isinstance(chosen, qc.Compressor):
            raise ValueError(f"compressor(path, leaf) must return a qcollect Compressor or "
                             f"None, got {type(chosen).__name__} for {jax.tree_util.keystr(path)}")
        return chosen

    return leaf_choices(tree, choose, min_size=min_size, compress_if=compress_if)


def check_compressor(name: str, value, *, per_leaf: bool = True, allow_none: bool = False):
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


def group_indices(keys: list) -> dict:
    """The positions of equal keys, ``{key: [i, ...]}`` in order of first
    appearance; None keys (uncompressed leaves) are left out."""
    groups: dict = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    return groups


def compressed_fraction(tree, compressors: list) -> float:
    """Fraction of the values of ``tree`` that go through a compressor."""
    sizes = [int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(tree)]
    total = sum(sizes)
    kept = sum(s for s, c in zip(sizes, compressors, strict=True) if c is not None)
    return kept / total if total else 0.0


def sum_uncompressed(leaves: list, compressed: list[bool], axis_name, *, mean: bool,
                     block_specs: list | None = None) -> list:
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
