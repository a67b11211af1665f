"""Quantizer benchmark: wire bits, error and speed of every compressor.

For one gradient-like float32 array (default 16M values as a 4096 x 4096
matrix, Gaussian with log-normal column scales so columns and buckets differ),
each compressor reports:

* wire bits per element, ``8 * payload_bytes / n`` of a real payload;
* relative error ``||decode(encode(x)) - x|| / ||x||``;
* median encode and decode time, next to the median time of one elementwise
  pass ``x * c`` over the same array measured in the same interleaved loop,
  and their ratio ``t(x * c) / t(encode + decode)`` (1.0 = as fast as one pass);
* the error-feedback round trip ``x - decode(encode(x))`` compiled as one
  program, as every training step computes it, in elementwise passes
  ``t(round trip) / t(x * c)``: once decoding the payload (``decode(encode(x))``)
  and once with `Compressor.round_trip` (the same values; 1-bit and QSGD
  take them from the encoding pass instead of unpacking the codes);
* the memory floor of encode + decode: the bytes their compiled kernels read
  and write (`qcollect.memory_bytes`: the cheapest branch of a conditional)
  over this machine's memory bandwidth, the fastest of a STREAM read, copy
  and triad over arrays of the same size timed in the same loop
  (`qcollect.bench.passes`), and the efficiency ``floor / (encode +
  decode)``: 1.0 when the codec moves its bytes at that rate. Caches and
  bounds of loops that XLA cannot know make it an estimate, not a bound,
  for the compressors that loop (threshold, adaptive, entropy).

Measured: docs/benchmarks.md, "Quantizers".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import qcollect as qc
from qcollect.bench._timing import interleaved_medians
from qcollect.bench.passes import bandwidths, stream_calls

#: Builds a compressor for the benchmark's array (some fit or plan on it).
Make = Callable[[jax.Array], qc.Compressor]


def _tau_leaving(x: jax.Array, fraction: float) -> float:
    """Strom's tau chosen to leave ``fraction`` of the values (Dryden Fig. 2: 1/32)."""
    return float(jnp.quantile(jnp.abs(x.reshape(-1)[::97]), 1.0 - fraction))


def _entropy_planned(x: jax.Array) -> qc.Compressor:
    """Oland & Raj with the plan for ``x`` (compiled once per plan, as in training)."""
    c = qc.entropy(floor=5)
    return c.with_plan(jax.tree.map(int, c.plan(x, jax.random.key(1))))


def _pca_fitted(x: jax.Array) -> qc.Compressor:
    """GradiVeQ, K = 64, d = 8, fitted on every slice of ``x`` (an upper bound on fit quality)."""
    fit = qc.pca_fit(x.reshape(1, -1), slice_size=64, rank=8, slices="all")
    return qc.pca(fit.basis, fit.mean, num_workers=1)


def _powersgd_round(rank: int) -> Make:
    """One worker's PowerSGD round (Vogels et al. Alg. 1): send P = M Q and Q' = M^T P."""

    def make(x: jax.Array) -> qc.Compressor:
        q0 = qc.powersgd_init(jax.random.key(2), x.shape, rank)

        def encode(m: jax.Array, key: jax.Array | None = None) -> qc.Payload:
            p = qc.orthogonalize(qc.powersgd_p(qc.powersgd_matrix(m), q0))
            q = qc.powersgd_q(qc.powersgd_matrix(m), p)
            return qc.Payload({"p": p, "q": q}, tuple(m.shape), m.dtype, "powersgd-round")

        def decode(payload: qc.Payload) -> jax.Array:
            m = qc.powersgd_reconstruct(payload["p"], payload["q"])
            return m.reshape(payload.shape).astype(payload.dtype)

        return qc.Compressor("powersgd-round", encode, decode, linear=False, stochastic=False)

    return make


def _collective_layout(make: Make, n: int = 4) -> Make:
    """The codec as `qcollect.compressed_all_reduce` runs it on ``n`` devices
    (`qcollect.collective_codec`): side by side with the plain rows this is
    what the layout costs."""
    return lambda x: qc.collective_codec(make(x), x, n)


COMPRESSORS: dict[str, Make] = {
    "identity": lambda x: qc.identity(),
    "cast-bf16": lambda x: qc.cast("bfloat16"),
    "cast-fp16": lambda x: qc.cast("float16"),
    "onebit (bucket 64)": lambda x: qc.onebit(),
    "onebit (column)": lambda x: qc.onebit(grouping="column"),
    "onebit (bucket 64), collective layout, 4 chunks": _collective_layout(
        lambda x: qc.onebit()),
    "onebit (column), collective layout, 4 chunks": _collective_layout(
        lambda x: qc.onebit(grouping="column")),
    "onebit (bucket 64, sample 8)": lambda x: qc.onebit(sample=8),
    "qsgd-2 (bucket 128)": lambda x: qc.qsgd(bits=2),
    "qsgd-4 (bucket 512)": lambda x: qc.qsgd(bits=4),
    "qsgd-4 nearest": lambda x: qc.qsgd(bits=4, stochastic=False),
    "qsgd-8 (bucket 512)": lambda x: qc.qsgd(bits=8),
    "qsgd-16 (bucket 8192)": lambda x: qc.qsgd(bits=16),
    # tau leaves ~1/40 of the values, inside the default 1/32 capacity.
    "threshold (capacity 1/32)": lambda x: qc.threshold(_tau_leaving(x, 1 / 40)),
    "threshold golomb-rice": lambda x: qc.threshold(_tau_leaving(x, 1 / 40),
                                                    coding="golomb_rice"),
    "threshold overflowing (1/16 over 1/32)": lambda x: qc.threshold(_tau_leaving(x, 1 / 16)),
    "adaptive (pi 64, column)": lambda x: qc.adaptive(64),
    "adaptive (pi 64, column, sample 256)": lambda x: qc.adaptive(64, sample=256),
    "entropy (c 5, huffman)": _entropy_planned,
    "pca (K 64, d 8)": _pca_fitted,
    "powersgd round (rank 4)": _powersgd_round(4),
}


def gradient_like(size: int, seed: int = 0) -> jax.Array:
    """A float32 (rows, cols) matrix of ``size`` values with log-normal column scales.

    ``cols`` is the largest power of two dividing ``size`` and at most its
    square root (4096 x 4096 for 16M values), so column grouping has columns.
    """
    cols = 1
    while size % (2 * cols) == 0 and (2 * cols) ** 2 <= size:
        cols *= 2
    k1, k2 = jax.random.split(jax.random.key(seed))
    scales = jnp.exp(0.5 * jax.random.normal(k1, (1, cols)))
    return jax.random.normal(k2, (size // cols, cols)) * scales * 1e-3


def run(size: int, repeats: int, names: list[str]) -> list[dict[str, Any]]:
    """One row per compressor of ``names`` on a `gradient_like` array of
    ``size`` values, printed as it is measured."""
    x = gradient_like(size)
    key = jax.random.key(1)
    norm = float(jnp.linalg.norm(x))
    scale_pass = jax.jit(lambda x: x * 1.5)
    stream = stream_calls(x, x * 2)
    rows = []
    for name in names:
        c = COMPRESSORS[name](x)
        encode, decode = jax.jit(c.encode), jax.jit(c.decode)
        payload = encode(x, key)
        err = float(jnp.linalg.norm(decode(payload).astype(jnp.float32) - x)) / norm
        unfused = jax.jit(lambda x, k, c=c: x - c.decode(c.encode(x, k)))
        fused = jax.jit(lambda x, k, c=c: x - c.round_trip(x, k)[1])
        t = interleaved_medians({
            "pass": (scale_pass, (x,)),
            **stream,
            "encode": (encode, (x, key)),
            "decode": (decode, (payload,)),
            "unfused": (unfused, (x, key)),
            "fused": (fused, (x, key)),
        }, repeats)
        codec_bytes = qc.memory_bytes(encode, x, key) + qc.memory_bytes(decode, payload)
        bandwidth = bandwidths(stream, t)["best"]
        floor = codec_bytes / bandwidth
        row = {
            "compressor": name,
            "bits_per_element": 8 * qc.payload_bytes(payload) / size,
            "relative_error": err,
            "encode_ms": 1e3 * t["encode"],
            "decode_ms": 1e3 * t["decode"],
            "pass_ms": 1e3 * t["pass"],
            "passes_ratio": t["pass"] / (t["encode"] + t["decode"]),
            "round_trip_passes": t["unfused"] / t["pass"],
            "fused_round_trip_passes": t["fused"] / t["pass"],
            "codec_traffic_gradients": codec_bytes / (4 * size),
            "memory_bandwidth_gbs": bandwidth / 1e9,
            "memory_floor_ms": 1e3 * floor,
            "memory_efficiency": floor / (t["encode"] + t["decode"]),
        }
        rows.append(row)
        print(_format_row(row), flush=True)
    return rows


HEADER = ("| compressor | wire bits/elem | rel. error | encode ms | decode ms "
          "| x*c ms | t(x*c)/t(enc+dec) | EF round trip, passes | fused, passes "
          "| enc+dec traffic / gradient | memory floor ms | efficiency |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _format_row(r: dict[str, Any]) -> str:
    return (f"| {r['compressor']} | {r['bits_per_element']:.3f} | {r['relative_error']:.4f} "
            f"| {r['encode_ms']:.1f} | {r['decode_ms']:.1f} | {r['pass_ms']:.1f} "
            f"| {r['passes_ratio']:.2f} | {r['round_trip_passes']:.2f} "
            f"| {r['fused_round_trip_passes']:.2f} | {r['codec_traffic_gradients']:.2f} "
            f"| {r['memory_floor_ms']:.1f} | {r['memory_efficiency']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    """Measures and prints the table; 0, or 2 for a bad argument."""
    parser = argparse.ArgumentParser(prog="python -m qcollect.bench quantizers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=16 * 1024 * 1024,
                        help="elements in the float32 array (default 16M)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions (median)")
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME",
                        help="compressors to run (substring match); default all")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.size < 1 or args.repeats < 1:
        parser.error("--size and --repeats must be >= 1")
    names = list(COMPRESSORS)
    if args.only:
        names = [n for n in names if any(s in n for s in args.only)]
        if not names:
            parser.error(f"--only matched none of: {', '.join(COMPRESSORS)}")
    print(f"# {args.size:,} float32 values on {jax.devices()[0].platform}, "
          f"median of {args.repeats} interleaved runs", flush=True)
    print(HEADER, flush=True)
    rows = run(args.size, args.repeats, names)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
