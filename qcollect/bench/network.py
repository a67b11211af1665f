"""Network benchmark: all-reduce across processes on a shaped local network.

``python -m qcollect.bench network`` starts itself under the launcher
(``python -m qcollect.launch --nproc 4 --bandwidth 1gbit``: four processes,
each in its own network namespace whose link is shaped to 1 Gbit/s each way)
and times, for float32 buffers of 1 to 64 MiB per process:

* ``psum``: ``lax.psum`` (XLA's all-reduce, Gloo's algorithm on CPU);
* ``psum-bf16``: the buffer cast to bfloat16 and summed by ``lax.psum``, what
  a user writes for a 16-bit all-reduce (XLA:CPU sums it as float32: the
  bytes of ``psum``);
* ``ring``: qcollect's uncompressed `ring_all_reduce` (``ppermute`` steps);
* `compressed_all_reduce` with ``cast-bf16`` and ``pca`` (compressed-domain
  ring; PCA of 64-value slices at rank 8, fitted on other draws of the same
  data) and ``qsgd-8``, ``qsgd-4`` (buckets of 512), ``onebit`` (buckets of 64) and
  ``adaptive`` (Dryden's proportion 64 per bucket of 512: a flat buffer has
  no weight-matrix columns) by pairwise exchange, with one re-quantization at
  the chunk's owner.

The buffers are gradient-like (`qcollect.bench.collectives`), a different
draw per process; the error is ``||estimate - sum|| / ||sum||`` of one
all-reduce without error feedback.

Every repetition runs all methods one after the other (interleaved, so a slow
moment of the shared machine hits every column); the table gives medians,
the wire bytes each process sends per call (read from the compiled HLO by
`qcollect.wire_bytes`), the speedup over ``psum`` and the relative error of
the sum. Rank 0 writes ``OUT.csv``, ``OUT.md`` and ``OUT.png``.

The physical limits: run directly on a shaped network, the benchmark then
runs the same programs again on an unshaped loopback network (``OUT_unshaped``)
and gives every row two floors: the wire floor, the bytes each process sends
over the link rate (``8 * wire bytes / rate``: no program is faster on that
link), and the unshaped time, what the same compiled program takes when the
link does not limit it (codec, memory traffic and the collective's own
overhead: the codec floor where the processes share few cores). ``efficiency``
is ``max(wire floor, unshaped) / median``: 1.0 when the transfer and the
codec overlap perfectly, 0.5 when they run one after the other and are
equally long. ``of wire ratio`` is the speedup over psum divided by the
wire-byte ratio: the share of what the bytes saved promise that the method
delivers (wire-bound regime). ``--no-floors`` skips the unshaped run.

Multi-node: with ``--devices-per-process K`` each process is a node of K
devices (uncompressed collectives inside it, the shaped link between
nodes); every compressed method is measured both over all devices as one
axis and as ``METHOD/h``, the hierarchical all-reduce over ``("node",
"local")``, and a column gives the bytes each device sends across nodes
(`qcollect.wire_bytes_by_axis`; for ``psum`` and the one-axis methods, all
bytes of collectives whose groups span nodes). ``wire vs psum`` then
compares bytes across nodes. The wire floor is a process's bytes on its
link over the link rate (``link bytes``: every collective-permute pair
leaving the process, and for the other collectives the steps of Gloo's ring
that leave it).

Run it directly (``--bandwidth none`` for an unshaped loopback network, which
needs no root), or under your own launcher command; it detects a launched
process and then only measures::

    python -m qcollect.bench network --out network
    python -m qcollect.launch --nproc 2 qcollect/bench/network.py --sizes 1,4

``--node-probe`` (with ``--devices-per-process`` > 1) times, instead, the
collectives inside a node that the hierarchical all-reduce can use: XLA's
``lax.psum_scatter`` against `qcollect.ring_reduce_scatter`, with
``lax.psum`` and the all-gather for scale.

``--message-probe`` times, instead, what a collective costs per array it
carries: a buffer cut into 1 to 128 arrays summed by one ``lax.psum`` of the
list against `qcollect.fused_psum`, and a one-bit payload sent by one
``ppermute`` per array against `qcollect.permute`, which packs them into one
buffer.

``--swap-probe`` times, instead, a swap of the buffer between devices r and
r + N/2 in one collective-permute and in the pieces `qcollect.permute` sends
across processes on the CPU backend.

The measured tables of every mode, each beside its command, are in
docs/multiprocess.md and docs/benchmarks.md ("Network: the physical limits"
and the sections after it).
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import subprocess
import sys
from typing import Any

import qcollect as qc
import qcollect.launch
from qcollect.bench.compile import parse_batch_buckets
from qcollect.launch import parse_rate

METHODS = ("psum", "psum-bf16", "ring", "cast-bf16", "qsgd-8", "qsgd-4", "onebit", "adaptive",
           "pca")


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m qcollect.bench network``."""
    p = argparse.ArgumentParser(prog="python -m qcollect.bench network",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    p.add_argument("--devices-per-process", type=int, default=1, metavar="K",
                   help="simulated CPU devices per process (default 1); with more, each "
                        "process is a node and every compressed method is measured also "
                        "as METHOD/h: hierarchical over (node, local), uncompressed inside "
                        "a process")
    p.add_argument("--bandwidth", default=None,
                   help="link rate per process (tc units) or 'none' for no shaping "
                        "(default 1gbit; shaping needs root, ip and tc)")
    p.add_argument("--sizes", default="1,4,16,64",
                   help="comma-separated buffer sizes in MiB per process (default 1,4,16,64)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--pipeline", default="1",
                   help="comma-separated pipeline counts (compressed_all_reduce's pipeline=): "
                        "each compressed method is measured once per count, as METHOD/pN "
                        "(default 1)")
    p.add_argument("--leaves", type=int, default=1,
                   help="cut each process's buffer into this many equal leaves (a list), so "
                        "that a buffer of several buckets is a class of equal leaves "
                        "(default 1: one array)")
    p.add_argument("--bucket-mib", type=float, default=4.0,
                   help="bucket size in MiB (compressed_all_reduce's and ring_all_reduce's "
                        "bucket_bytes; default 4)")
    p.add_argument("--batch-buckets", default="",
                   help="comma-separated batch_buckets values ('auto', 'always', 'never' or "
                        "ints >= 0): each compressed method is measured once per value, as "
                        "METHOD@B, so a batch of equal buckets (@always) and the program "
                        "traced bucket by bucket (@never) run side by side (default: the "
                        "library's default only)")
    p.add_argument("--exchange", default="",
                   help="comma-separated exchange values ('permute', 'all_to_all'): "
                        "each compressed method is measured once per value, as METHOD:X "
                        "(default: the library's default only)")
    p.add_argument("--repeats", type=int, default=7,
                   help="timed repetitions per size, medians reported (default 7)")
    p.add_argument("--swap-probe", action="store_true",
                   help="instead: time a swap between device r and r + N/2 in one "
                        "collective-permute and in qcollect's pieces (writes OUT.md)")
    p.add_argument("--message-probe", action="store_true",
                   help="instead: time arrays summed or sent one collective each against "
                        "one buffer (qc.fused_psum, qcollect's permute) (writes OUT.md)")
    p.add_argument("--node-probe", action="store_true",
                   help="instead: time the collectives inside a node (reduce-scatter as "
                        "XLA's psum_scatter and as a ppermute ring, psum, all-gather) with "
                        "--devices-per-process > 1 (writes OUT.md)")
    p.add_argument("--out", default="network",
                   help="output path without suffix: OUT.csv, OUT.md, OUT.png (default network)")
    p.add_argument("--no-floors", action="store_true",
                   help="on a shaped network: skip the unshaped run that gives the codec "
                        "floor and efficiency columns")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parses and checks the command line (lists for the comma-separated
    options); SystemExit 2 naming a bad argument."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated numbers of MiB, got {args.sizes!r}")
    if not sizes or not all(math.isfinite(s) and s > 0 for s in sizes):
        parser.error(f"--sizes must be positive, finite numbers of MiB, got {args.sizes!r}")
    args.sizes = list(dict.fromkeys(sizes))
    args.methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        parser.error(f"--methods must name some of {', '.join(METHODS)}; unknown: {unknown}")
    try:
        args.pipeline = list(dict.fromkeys(int(p) for p in args.pipeline.split(",") if p.strip()))
    except ValueError:
        parser.error(f"--pipeline must be comma-separated positive integers, got {args.pipeline!r}")
    if not args.pipeline or min(args.pipeline) < 1:
        parser.error(f"--pipeline must be comma-separated positive integers, got {args.pipeline!r}")
    args.batch_buckets = tuple(dict.fromkeys(
        b.strip() for b in args.batch_buckets.split(",") if b.strip()))
    try:
        for b in args.batch_buckets:
            parse_batch_buckets(b)
    except ValueError as e:
        parser.error(f"--batch-buckets: {e}")
    args.exchange = tuple(dict.fromkeys(e.strip() for e in args.exchange.split(",") if e.strip()))
    bad = sorted(set(args.exchange) - set(qc.EXCHANGES))
    if bad:
        parser.error(f"--exchange must name some of {', '.join(qc.EXCHANGES)}; "
                     f"unknown: {bad}")
    if not (math.isfinite(args.bucket_mib) and args.bucket_mib > 0):
        parser.error(f"--bucket-mib must be a positive number, got {args.bucket_mib}")
    args.bucket_bytes = max(1, int(args.bucket_mib * 2**20))
    if args.leaves < 1:
        parser.error(f"--leaves must be a positive integer, got {args.leaves}")
    if args.repeats < 1:
        parser.error("--repeats must be a positive integer")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be a positive integer, "
                     f"got {args.devices_per_process}")
    if args.nproc < 2:
        parser.error(f"--nproc must be at least 2 (processes that talk over the network), "
                     f"got {args.nproc}")
    if args.node_probe and args.devices_per_process < 2:
        parser.error("--node-probe needs --devices-per-process of at least 2")
    if args.swap_probe and args.nproc % 2:
        parser.error(f"--swap-probe pairs device r with r + N/2: --nproc must be even, "
                     f"got {args.nproc}")
    return args


def launch_command(argv: list[str], nproc: int, bandwidth: str,
                   devices_per_process: int = 1) -> list[str]:
    """The launcher command line that runs this file with ``argv`` on ``nproc`` processes."""
    cmd = [sys.executable, "-m", "qcollect.launch", "--nproc", str(nproc),
           "--devices-per-process", str(devices_per_process)]
    if bandwidth.lower() != "none":
        cmd += ["--bandwidth", bandwidth]
    return cmd + [str(pathlib.Path(__file__).resolve()), *argv]


def main(argv: list[str] | None = None) -> int:
    """Outside a job: launches the benchmark (and the unshaped run of the
    floors) and returns the launcher's status. In a job: joins it, measures,
    and writes the results on process 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if qcollect.launch.job() is None:  # not in a job: start one with the local launcher
        bandwidth = args.bandwidth or "1gbit"
        rc = subprocess.call(launch_command(argv + ["--bandwidth", bandwidth],
                                            args.nproc, bandwidth, args.devices_per_process))
        if (rc or args.swap_probe or args.node_probe or args.message_probe or args.no_floors
                or bandwidth.lower() == "none"):
            return rc
        out = pathlib.Path(args.out)
        unshaped = out.with_name(out.name + "_unshaped")
        rc = subprocess.call(launch_command(argv + ["--bandwidth", "none", "--out", str(unshaped)],
                                            args.nproc, "none", args.devices_per_process))
        if rc == 0:
            add_floors(out, unshaped, parse_rate(bandwidth))
        return rc
    qcollect.launch.initialize()

    from qcollect.bench import _network

    probes = {"swap": args.swap_probe, "node": args.node_probe, "message": args.message_probe}
    if any(probes.values()):
        probe = getattr(_network, next(k for k, v in probes.items() if v) + "_probe")
        text = probe(args.sizes, args.repeats)
        if text is not None:
            out = pathlib.Path(args.out).with_suffix(".md")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")
            print(f"wrote {out}", flush=True)
        return 0
    methods = _network.variants(args.methods, args.pipeline,
                                hierarchical=_network.meshes()[1] is not None,
                                batches=args.batch_buckets, exchanges=args.exchange)
    rows = _network.measure(args.sizes, methods, args.repeats, leaves=args.leaves,
                            bucket_bytes=args.bucket_bytes)
    if rows is not None:  # rank 0
        write(rows, pathlib.Path(args.out), args.bandwidth)
    return 0


def _read(path: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of ``path.csv``, every value a string."""
    with open(path.with_suffix(".csv"), newline="") as f:
        return list(csv.DictReader(f))


def add_floors(out: pathlib.Path, unshaped: pathlib.Path, rate_bits: int) -> None:
    """Adds the wire floor, the unshaped time and the efficiency to ``out.csv``
    and ``out.md`` (rows matched by size and method with ``unshaped.csv``)."""
    from qcollect.bench import _network

    reference = {(r["mib"], r["method"]): float(r["median_ms"]) for r in _read(unshaped)}
    rows = _network.with_floors(_read(out), reference, rate_bits)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out.with_suffix(".md").write_text(_network.table(rows) + "\n")
    print(f"{_network.table(rows)}\nwrote {out.with_suffix('.csv')}, {out.with_suffix('.md')} "
          f"(floors from {unshaped.with_suffix('.csv')})", flush=True)


def write(rows: list[dict[str, Any]], out: pathlib.Path, bandwidth: str | None) -> None:
    """``out.csv`` (every row), ``out.md`` (the table) and ``out.png`` (time vs size)."""
    from qcollect.bench import _network

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out.with_suffix(".md").write_text(_network.table(rows) + "\n")
    written = [out.with_suffix(".csv"), out.with_suffix(".md")]
    if _network.plot(rows, out.with_suffix(".png"), bandwidth or "of unknown rate"):
        written.append(out.with_suffix(".png"))
    print("wrote " + ", ".join(map(str, written)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
