"""Compressed all-reduce: three algorithms from the seed papers.

All three cut the (fused, flattened) buffer into N chunks, one per device of
``axis_name``, and differ in where encoding and decoding happen:

``"ring"`` -- compressed-domain ring (Yu et al., GradiVeQ, Algorithm 1 and
  eq. 1). For linear compressors only. Every device encodes its own chunks;
  payloads are summed hop by hop *without decoding* during N - 1
  scatter-reduce steps; the aggregated compressed chunks are all-gathered
  around the ring and each is decoded once. Exact for ``identity``; for
  ``cast`` the sums round in the narrow dtype; for ``pca`` the mean term
  ``mu / N`` added by every device makes the decoded sum exact (eq. 4-5).

``"pairwise"`` -- pairwise-exchange reduce-scatter + ring all-gather with one
  re-quantization at the owner (Dryden et al. section 3.4; DeepSpeed's
  compressed all-reduce). Each chunk is encoded once by its origin and sent
  straight to its owner over N - 1 `ppermute` shifts (shift t moves chunk
  ``r + t`` from device r to device ``r + t``; each shift is its own
  permutation, so they are unrolled rather than looped); the owner decodes
  and sums the N payloads, re-encodes its reduced chunk once, and a ring
  all-gather moves that compressed result. The owner's re-encoding error is
  returned for a second level of error feedback.

``"ring_requantize"`` -- the classic ring where every hop decodes what it
  received, adds its own chunk and re-encodes (as in CGX). Quantization error
  is added at every one of the N - 1 hops, so the error of the sum grows with
  N; ``contributed`` can only report the first hop's encoding, the later
  re-encoding errors belonging to no single device.

Randomness: every device uses ``fold_in(key, axis_index)``, then one more
``fold_in`` per chunk, hop or buffer, so no two encodings share a stream.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qcollect._config import check_choice
from qcollect._fusion import BUCKET_BYTES, fuse_by_dtype
from qcollect._payload import Compressor
from qcollect._ring import (
    as_varying,
    chunk_rows,
    permute,
    ring_all_gather,
    shift_right,
    split_chunks,
    take_chunk,
)

__all__ = ["ALGORITHMS", "AllReduceResult", "compressed_all_reduce"]

ALGORITHMS = ("ring", "pairwise", "ring_requantize")


class AllReduceResult(NamedTuple):
    """What `compressed_all_reduce` returns.

    Attributes:
      value: the estimate of the sum (or mean) over devices, like ``x``.
      contributed: what this device's own encodings decode to, like ``x``; for
        error feedback keep ``x - contributed``.
      owner_error: ``"pairwise"`` only (else None): like ``x``, zero outside
        the chunk this device owns, and there the owner's re-encoding error
        ``reduced - decode(encode(reduced))`` (in sum units). Pass it back as
        ``owner_residual`` next step for two-level error feedback.
    """

    value: Any
    contributed: Any
    owner_error: Any


def _vmap_codec(compressor: Compressor):
    encode = jax.vmap(compressor.encode)
    decode = jax.vmap(compressor.decode)
    return encode, decode


def _chunk_keys(key, n: int):
    return jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n))


def _ring_compressed(chunks, axis_name, compressor, key, n, me):
    encode, decode = _vmap_codec(compressor)
    payloads = encode(chunks, _chunk_keys(key, n))
    own = lambda j: jax.tree.map(lambda leaf: take_chunk(leaf, j), payloads)  # noqa: E731

    def step(s, acc):
        received = shift_right(acc, axis_name, n)
        return jax.tree.map(jnp.add, received, own(me - s - 2))

    reduced = lax.fori_loop(0, n - 1, step, as_varying(own(me - 1), axis_name))
    gathered = jax.tree.map(lambda leaf: ring_all_gather(leaf[None], axis_name), reduced)
    return decode(gathered), decode(payloads), None


def _pairwise(chunks, axis_name, compressor, key, n, me, owner_residual):
    encode, decode = _vmap_codec(compressor)
    payloads = encode(chunks, _chunk_keys(key, n))
    mine = lambda j: jax.tree.map(lambda leaf: take_chunk(leaf, j), payloads)  # noqa: E731
    # received[t] comes from device me - t and encodes chunk `me`.
    received = [mine(me)]
    for t in range(1, n):
        perm = [(i, (i + t) % n) for i in range(n)]
        received.append(permute(mine(me + t), axis_name, perm))
    # Decode and add one payload at a time: one fused elementwise pass.
    # (Stacking the decodes and summing over axis 0 is a major-axis reduction,
    # which XLA:CPU runs many times slower than the adds.)
    reduced = functools.reduce(
        operator.add, [compressor.decode(p).astype(jnp.float32) for p in received])
    if owner_residual is not None:
        reduced = reduced + take_chunk(owner_residual, me).astype(jnp.float32)
    requantized = compressor.encode(reduced.astype(chunks.dtype),
                                    jax.random.fold_in(key, n))
    error = reduced - compressor.decode(requantized).astype(jnp.float32)
    gathered = jax.tree.map(lambda leaf: ring_all_gather(leaf[None], axis_name), requantized)
    owner_error = lax.dynamic_update_index_in_dim(
        jnp.zeros(chunks.shape, jnp.float32), error, me, 0)
    return decode(gathered), decode(payloads), owner_error


def _ring_requantize(chunks, axis_name, compressor, key, n, me):
    encode_one = compressor.encode
    first = encode_one(take_chunk(chunks, me - 1), jax.random.fold_in(key, 0))
    contributed = lax.dynamic_update_index_in_dim(
        chunks, compressor.decode(first).astype(chunks.dtype), (me - 1) % n, 0)

    def step(s, payload):
        received = shift_right(payload, axis_name, n)
        partial = (compressor.decode(received).astype(jnp.float32)
                   + take_chunk(chunks, me - s - 2).astype(jnp.float32))
        # Constant payload leaves (e.g. PCA's weight) must stay varying like the carry.
        return as_varying(encode_one(partial.astype(chunks.dtype), jax.random.fold_in(key, s + 1)),
                          axis_name)

    reduced = lax.fori_loop(0, n - 1, step, as_varying(first, axis_name))
    gathered = jax.tree.map(lambda leaf: ring_all_gather(leaf[None], axis_name), reduced)
    return jax.vmap(compressor.decode)(gathered), contributed, None


def chunk_length(size: int, n: int, compressor: Compressor) -> int:
    """Values per device chunk of a ``size``-value buffer on ``n`` devices.

    ``ceil(size / n)`` rounded up to the compressor's block (bucket, slice), so
    chunks group values as one encoding of the whole buffer would; a block
    larger than a device's share is ignored rather than padded to.
    """
    share = -(-size // n)
    block = compressor.block if compressor.block <= share else 1
    return chunk_rows(size, n, block)


def _reduce_flat(flat, axis_name, compressor, key, algorithm, owner_residual):
    n = int(lax.axis_size(axis_name))
    size = flat.shape[0]
    if size == 0 or n == 1:
        payload = compressor.encode(flat, key)
        decoded = compressor.decode(payload)
        owner_error = jnp.zeros(flat.shape, jnp.float32) if algorithm == "pairwise" else None
        return decoded, decoded, owner_error
    me = lax.axis_index(axis_name)
    rows = chunk_length(size, n, compressor)
    chunks = split_chunks(as_varying(flat, axis_name), n, rows)
    if algorithm == "ring":
        value, contributed, owner_error = _ring_compressed(
            chunks, axis_name, compressor, key, n, me)
    elif algorithm == "pairwise":
        residual = None if owner_residual is None else split_chunks(owner_residual, n, rows)
        value, contributed, owner_error = _pairwise(
            chunks, axis_name, compressor, key, n, me, residual)
    else:
        value, contributed, owner_error = _ring_requantize(
            chunks, axis_name, compressor, key, n, me)
    unchunk = lambda c: None if c is None else c.reshape(-1)[:size]  # noqa: E731
    return unchunk(value), unchunk(contributed), unchunk(owner_error)


def compressed_all_reduce(x, axis_name, compressor: Compressor, key=None, *,
                          algorithm: str = "auto", mean: bool = False, fuse: bool = True,
                          bucket_bytes: int | None = BUCKET_BYTES,
                          owner_residual=None) -> AllReduceResult:
    """All-reduce of an array or pytree with every hop compressed.

    Args:
      x: array or pytree of arrays, this device's contribution.
      axis_name: the mapped axis (inside `jax.shard_map` or `jax.pmap`).
      compressor: any qcollect `Compressor`.
      key: PRNG key (needed by stochastic compressors); folded with the
        device index, so pass the same key on every device.
      algorithm: ``"ring"`` (linear compressors), ``"pairwise"``,
        ``"ring_requantize"``, or ``"auto"``: ring for linear compressors,
        else pairwise. See the module docstring.
      mean: divide the sum by the number of devices.
      fuse: concatenate leaves of one dtype into buffers first (default), so
        small leaves ride together; with False every leaf is reduced on its
        own.
      bucket_bytes: cap of a fused buffer (default 4 MiB, like the buckets of
        PyTorch DDP): leaves fill a buffer in tree order until the next would
        pass the cap, and a leaf of ``bucket_bytes`` or more is reduced on its
        own, so large leaves are not copied into a concatenation. None: one
        buffer per dtype.
      owner_residual: ``"pairwise"`` only: the previous step's ``owner_error``
        (same structure as ``x``), added to the owner's reduced chunk before
        re-encoding.

    Returns:
      `AllReduceResult` ``(value, contributed, owner_error)``, each like ``x``
      (owner_error None unless pairwise). Values are typed varying along
      ``axis_name`` under ``shard_map``'s check (they agree across devices).

    Raises:
      ValueError: unknown algorithm, ``"ring"`` with a non-linear compressor,
        or ``owner_residual`` with another algorithm.

    References:
      Yu et al., GradiVeQ, Algorithm 1; Dryden et al. section 3.4;
      Gibiansky (ring all-reduce).
    """
    check_choice("algorithm", algorithm, ("auto",) + ALGORITHMS)
    if algorithm == "auto":
        algorithm = "ring" if compressor.linear else "pairwise"
    if algorithm == "ring" and not compressor.linear:
        raise ValueError(f"algorithm='ring' sums payloads in the compressed domain and needs "
                         f"a linear compressor; {compressor.name} is not (use 'pairwise')")
    if owner_residual is not None and algorithm != "pairwise":
        raise ValueError("owner_residual is only used by algorithm='pairwise'")
    if compressor.stochastic and key is None:
        raise ValueError(f"{compressor.name} is stochastic: pass key")
    if key is None:
        key = jax.random.key(0)
    key = jax.random.fold_in(key, lax.axis_index(axis_name))
    n = int(lax.axis_size(axis_name))

    buffers, unfuse = fuse_by_dtype(x, separate=not fuse, bucket_bytes=bucket_bytes)
    residuals = (fuse_by_dtype(owner_residual, x, separate=not fuse,
                               bucket_bytes=bucket_bytes)[0]
                 if owner_residual is not None else dict.fromkeys(buffers))
    parts = {name: _reduce_flat(flat, axis_name, compressor, jax.random.fold_in(key, i),
                                algorithm, residuals[name])
             for i, (name, flat) in enumerate(buffers.items())}
    value, contributed, owner = (
        unfuse({name: part[j] for name, part in parts.items()})
        if j < 2 or algorithm == "pairwise" else None for j in range(3))
    if mean:
        value = jax.tree.map(lambda v: (v / n).astype(v.dtype), value)
    return AllReduceResult(value, contributed, owner)
