"""GradiVeQ's two sums over devices: through the sample compressor in the
warm-up and sampling steps, and on the compressed-domain PCA ring (Yu et al.,
GradiVeQ, Algorithm 1) in the compressed steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qcollect as qc
from transforms._axes import AxisName, mesh_axes
from transforms._phases import COMPRESSED, LEAD_IN, SAMPLING
from transforms._policy import group_indices

if TYPE_CHECKING:
    from transforms._gradiveq import _Settings

__all__ = ["aggregate", "sum_on_pca_ring", "sum_sampled"]

#: ``(sums, contributed, votes)``: the leaves summed over devices, what this
#: device's encodings decode to (float32), and the stop-early votes.
Sums = tuple[list[jax.Array], list[jax.Array], jax.Array]


def aggregate(xs: list[jax.Array], bases: list[jax.Array], means: list[jax.Array],
              compressing: jax.Array, key: jax.Array, settings: _Settings) -> Sums:
    """The compressed leaves summed over devices: on the PCA ring in a
    compressed step (``compressing``, traced), else through the sample
    compressor; ``settings`` are `transforms.gradiveq`'s. The branches are
    marked with their phases (`qcollect.phase`): ``"compressed"``, and
    ``"warm-up"`` (when there are warm-up steps) and ``"sampling"``.

    Returns ``(sums, contributed, votes)`` (see `sum_on_pca_ring`).
    """
    s = settings
    sampled = (LEAD_IN, SAMPLING) if s.schedule.warmup_steps else (SAMPLING,)

    def on_ring() -> Sums:
        with qc.phase(COMPRESSED):
            return sum_on_pca_ring(xs, bases, means, s.axis_name, key, s.stop_loss,
                                   s.batch_buckets)

    def through_sample_compressor() -> Sums:
        with qc.phase(*sampled):
            return sum_sampled(xs, s.axis_name, s.sample_compressor, key, s.sample_algorithm,
                               s.batch_buckets)

    return lax.cond(compressing, on_ring, through_sample_compressor)


def sum_sampled(xs: list[jax.Array], axis_name: AxisName, compressor: qc.Compressor | None,
                key: jax.Array, algorithm: qc.Algorithm,
                batch: qc.BatchBuckets = qc.BATCH_BUCKETS) -> Sums:
    """Sum over devices through the sample compressor (or exactly): (sums, contributed)."""
    if compressor is None:
        sums = qc.fused_psum(list(xs), axis_name)
        return sums, list(xs), jnp.zeros((), jnp.int32)
    result = qc.compressed_all_reduce(xs, axis_name, compressor, key, algorithm=algorithm,
                                      batch_buckets=batch)
    return (list(result.value), [c.astype(jnp.float32) for c in result.contributed],
            jnp.zeros((), jnp.int32))


def sum_on_pca_ring(xs: list[jax.Array], bases: list[jax.Array], means: list[jax.Array],
                    axis_name: AxisName, key: jax.Array, stop_loss: float | None = None,
                    batch: qc.BatchBuckets = qc.BATCH_BUCKETS) -> Sums:
    """Compressed-domain ring sum, one PCA compressor per leaf.

    Leaves of one shape and basis shape form a class. Where
    `qcollect.runs_batched` says so for ``batch`` (by default: leaves of at
    most 4 MiB, or more than 16 larger ones), a class runs as one batch
    (`jax.vmap` over the leaves, each with its own basis, mean and key): the
    program holds one ring per class, not per leaf, and each hop carries the
    whole class's payloads in one message, for the price of a copy of the
    leaves into a stack (the rule and its measurements are those of the
    buckets of `qcollect.compressed_all_reduce`). Other classes run leaf by
    leaf. Results are the leaves' own either way.

    Returns ``(sums, contributed, votes)``: ``votes`` is the number of devices
    whose local compression loss (eq. 7) over ``||x||^2`` exceeds
    ``stop_loss`` (0 without it).
    """
    # The payloads summed: one per device, or one per node when hierarchical.
    axes = mesh_axes(axis_name)
    n = int(lax.axis_size(axes[0] if len(axes) == 2 else axis_name))

    def reduce_leaf(x: jax.Array, u: jax.Array, mu: jax.Array,
                    leaf_key: jax.Array) -> tuple[jax.Array, jax.Array]:
        result = qc.compressed_all_reduce(x, axis_name, qc.pca(u, mu, num_workers=n),
                                          leaf_key, algorithm="ring")
        return result.value.astype(jnp.float32), result.contributed.astype(jnp.float32)

    sums, contributed = [None] * len(xs), [None] * len(xs)
    classes = group_indices([tuple((jnp.shape(a), jnp.result_type(a)) for a in arrays)
                             for arrays in zip(xs, bases, means, strict=True)])
    for members in classes.values():
        keys = [jax.random.fold_in(key, j) for j in members]
        nbytes = int(np.prod(jnp.shape(xs[members[0]]))) * jnp.result_type(xs[members[0]]).itemsize
        if not qc.runs_batched(len(members), nbytes, batch):
            for j, leaf_key in zip(members, keys, strict=True):
                sums[j], contributed[j] = reduce_leaf(xs[j], bases[j], means[j], leaf_key)
            continue
        stacked = [jnp.stack([arrays[j] for j in members]) for arrays in (xs, bases, means)]
        class_sums, class_contributed = jax.vmap(reduce_leaf)(*stacked, jnp.stack(keys))
        for t, j in enumerate(members):
            sums[j], contributed[j] = class_sums[t], class_contributed[t]
    if stop_loss is None:
        return sums, contributed, jnp.zeros((), jnp.int32)
    loss = sum(jnp.sum((x - c) ** 2) for x, c in zip(xs, contributed, strict=True))
    energy = sum(jnp.sum(x ** 2) for x in xs)
    vote = (loss > stop_loss * energy).astype(jnp.int32)
    return sums, contributed, lax.psum(vote, axis_name)
