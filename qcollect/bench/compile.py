"""Compile benchmark: compile time and program size of a compressed all-reduce.

For a transformer-shaped float32 gradient pytree (``blocks`` blocks, each a
dict of four ``d x d`` attention matrices ``q, k, v, o``, a ``d x 4d`` and a
``4d x d`` MLP matrix and four ``d``-vectors: 10 leaves, ``12 d^2 + 4 d``
parameters; ``d = 512`` gives 3,147,776 per block), every method is
compiled as one training step would compile it, on ``N`` simulated CPU
devices::

    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))

with ``f`` the all-reduce of this device's own (varying) gradient:
``lax.psum`` of the tree, or ``qcollect.compressed_all_reduce(...).value``.
Nothing is allocated: the program is lowered from ``jax.ShapeDtypeStruct`` values
with shardings and compiled, never run. Each method and size reports the
wall seconds of ``lower`` (tracing included) and of ``compile``, the size of
the lowered StableHLO text and of the optimised HLO text
(``compiled.as_text()``), its kernels (fusions) and how many of them are
distinct programs (`kernel_counts`: XLA generates code once per distinct
one), and XLA's scratch memory of one device's step
(``compiled.memory_analysis().temp_size_in_bytes``: intermediates, not
counting the gradients in and the sums out).

Methods are ``METHOD`` or ``METHOD/ALGORITHM`` (``ring``, ``pairwise``,
``ring_requantize``; without one, `compressed_all_reduce`'s ``"auto"``:
ring for linear compressors, else pairwise), e.g. ``qsgd-4/ring_requantize``,
with an optional ``@B`` for `compressed_all_reduce`'s ``batch_buckets``
(``qsgd-4@always``: every class of equal buckets as one batch;
``qsgd-4@never``: one traced copy per bucket; ``qsgd-4@auto``: the default,
by bucket size; ``qsgd-4@K``: classes of more than K buckets batched), so
the programs compare side by side.

Each method's sizes are compiled, smallest first, by one worker process that
first compiles the method once on a tiny tree (so the first size does not pay
JAX's one-time start-up); a compile that runs past ``--timeout`` is killed,
reported as ``> T s``, and the method's larger sizes are skipped::

    python -m qcollect.bench compile --params 19,38 --methods psum,qsgd-4 --out compile

Measured: docs/benchmarks.md, "Compile time and program size".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from qcollect.bench._options import parse_batch_buckets
from qcollect.bench.workload import (
    block_params,
    block_shapes,
    blocks_for,
    format_cell,
    tables,
)

if TYPE_CHECKING:
    import jax

    import qcollect as qc

_MARK = "@@qcollect-compile "  # prefix of the worker's result lines on stdout
_AXIS = "d"
_WARM_UP_S = 120  # least limit of a worker's start: JAX's import and the tiny warm-up compile


def _pca(n: int) -> qc.Compressor:
    """GradiVeQ's PCA of 64-value slices at rank 8 (a fixed orthonormal basis and mean).

    Only shapes matter to the compiler; the basis is a constant of the program,
    as it is when a fitted basis is closed over.
    """
    import qcollect as qc

    rng = np.random.default_rng(0)
    basis = np.linalg.qr(rng.standard_normal((64, 8)))[0].astype(np.float32)
    return qc.pca(basis, rng.standard_normal(64).astype(np.float32), num_workers=n)


def _compressors() -> dict[str, Callable[[int], qc.Compressor]]:
    """Method name -> the compressor for ``n`` devices (imports JAX: workers only)."""
    import qcollect as qc

    return {
        "identity": lambda n: qc.identity(),
        "cast-bf16": lambda n: qc.cast("bfloat16"),
        "qsgd-8": lambda n: qc.qsgd(bits=8),
        "qsgd-4": lambda n: qc.qsgd(bits=4),
        "qsgd-2": lambda n: qc.qsgd(bits=2),
        "onebit": lambda n: qc.onebit(),
        "onebit-column": lambda n: qc.onebit(grouping="column"),
        "adaptive": lambda n: qc.adaptive(64),
        "entropy": lambda n: qc.entropy(),
        "pca": _pca,
    }


METHODS = ("psum", "identity", "cast-bf16", "qsgd-8", "qsgd-4", "qsgd-2", "onebit",
           "onebit-column", "adaptive", "entropy", "pca")
DEFAULT_METHODS = ("psum", "qsgd-4", "onebit", "pca")
DEFAULT_PARAMS = "19,38,76,151,1000"


def parse_method(method: str, devices: int = 2) -> (
        tuple[qc.Compressor, qc.Algorithm, qc.BatchBuckets] | tuple[None, None, None]):
    """``(compressor or None, algorithm, batch_buckets)`` of
    ``METHOD[/ALGORITHM][@BATCH]``.

    ``@BATCH`` sets `compressed_all_reduce`'s ``batch_buckets``: ``@auto``
    (the default: batched by bucket size, `qcollect.runs_batched`),
    ``@always`` (every class of equal buckets runs as one batch), an int
    ``@K`` (classes of more than K buckets) or ``@never`` (the
    program traced once per bucket); without it, the default.

    Raises:
      ValueError: an unknown method or algorithm, an algorithm or a batch
        setting given for ``psum``, a batch setting that is not ``auto``,
        ``always``, ``never`` or an int >= 0,
        or ``ring`` for a compressor that is not linear.
    """
    import qcollect as qc
    from qcollect.bench import _options

    spec, at, batch_text = method.partition("@")
    name, _, algorithm_text = spec.partition("/")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} in {method!r}; "
                         f"known: {', '.join(METHODS)}")
    if name == "psum":
        if algorithm_text or at:
            raise ValueError(f"psum takes no algorithm or batch_buckets, got {method!r}")
        return None, None, None
    batch: qc.BatchBuckets = qc.BATCH_BUCKETS
    if at:
        try:
            batch = parse_batch_buckets(batch_text)
        except ValueError:
            raise ValueError(f"batch_buckets in {method!r} must be 'auto', 'always', 'never' "
                             "or an int >= 0") from None
    try:
        algorithm = _options.algorithm(algorithm_text or "auto")
    except ValueError:
        raise ValueError(f"unknown algorithm {algorithm_text!r} in {method!r}; "
                         f"known: {', '.join(qc.ALGORITHMS)}") from None
    compressor = _compressors()[name](devices)
    if algorithm == "ring" and not compressor.linear:
        raise ValueError(f"{method!r}: the compressed-domain ring needs a linear compressor")
    return compressor, algorithm, batch


_HEADER = re.compile(r"(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_NAME = re.compile(r"%([\w.\-]+)")
_METADATA = re.compile(r", metadata=\{[^}]*\}")
_FUSION = re.compile(r"= \S+ fusion\(.*?kind=(\w+), calls=%([\w.\-]+)(.*)$")


def kernel_counts(hlo: str) -> tuple[int, int]:
    """``(kernels, distinct)``: the fusions of an optimised HLO text (each one
    kernel of machine code) and how many of them differ once instruction names
    and metadata are set aside.

    XLA generates machine code for each distinct fused computation once,
    however many fusions call it, so ``distinct`` is the program that XLA's
    code generation pays for; the HLO text prints every fusion's body.
    """
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = bodies.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        else:
            current.append(_METADATA.sub("", line))
    canonical: dict[str, str] = {}

    def body(name: str) -> str:
        """A computation's text with its names numbered in order of use and the
        computations it calls replaced by theirs: equal for equal programs."""
        if name not in canonical:
            canonical[name] = name  # a guard; XLA computations do not recurse
            ids: dict[str, int] = {}
            lines = [_NAME.sub(lambda m: f"%{ids.setdefault(m.group(1), len(ids))}",
                               _CALLEE.sub(lambda m: f"{m.group(1)}={body(m.group(2))}", line))
                     for line in bodies.get(name, ())]
            canonical[name] = hashlib.sha1("\n".join(lines).encode()).hexdigest()
        return canonical[name]

    fusions = []
    for line in hlo.splitlines():
        fusion = _FUSION.search(_METADATA.sub("", line))
        if fusion:
            kind, callee, options = fusion.groups()
            fusions.append((kind, body(callee), options))
    return len(fusions), len(set(fusions))


def _lower_and_compile(mesh: jax.sharding.Mesh, method: str, blocks: int, width: int,
                       runs: int = 0, profile: int = 0) -> dict[str, Any]:
    """Lowers and compiles ``method`` for ``blocks`` blocks on ``mesh``; with
    ``runs``, then also runs it that many times on random gradients (the
    only case where anything is allocated) and adds the median ``step_ms``;
    with ``profile``, also the ``profile`` operations with the most device
    time (what ``--profile`` prints)."""
    import jax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import qcollect as qc

    n = mesh.shape[_AXIS]
    parsed = parse_method(method, n)
    varying = NamedSharding(mesh, P(_AXIS))
    # Each device's own gradient: a leading device axis, sharded, so it is varying.
    tree = {f"block_{b:04d}": {name: jax.ShapeDtypeStruct((n, *shape), np.float32,
                                                          sharding=varying)
                               for name, shape in block_shapes(width).items()}
            for b in range(blocks)}
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=NamedSharding(mesh, P()))

    def body(grads: Any, key: jax.Array) -> Any:
        grads = jax.tree.map(lambda g: g[0], grads)
        if parsed[0] is None:
            return lax.psum(grads, _AXIS)
        compressor, algorithm, batch = parsed
        return qc.compressed_all_reduce(grads, _AXIS, compressor, key, algorithm=algorithm,
                                        batch_buckets=batch).value

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(_AXIS), P()), out_specs=P()))
    start = time.perf_counter()
    lowered = fn.lower(tree, key)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    hlo = compiled.as_text()
    record = {"lower_s": lowered_at - start, "compile_s": compiled_at - lowered_at,
              "stablehlo_bytes": len(lowered.as_text()), "hlo_bytes": len(hlo),
              "hlo_lines": hlo.count("\n")}
    record["kernels"], record["distinct_kernels"] = kernel_counts(hlo)
    memory = compiled.memory_analysis()
    if memory is not None:
        # Per device: XLA's scratch buffers of the step (intermediates).
        record["temp_bytes"] = int(memory.temp_size_in_bytes)
    if runs:
        grads = jax.tree.map(
            lambda s: jax.device_put(jax.random.normal(jax.random.key(0), s.shape), varying),
            tree)
        args = (grads, jax.device_put(jax.random.key(1), NamedSharding(mesh, P())))
        jax.block_until_ready(compiled(*args))  # warm
        times = []
        for _ in range(runs):
            begin = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - begin)
        record["step_ms"] = 1e3 * float(np.median(times))
        if profile:
            from qcollect.bench._profile import op_times

            record["profile"] = op_times(compiled, args)[:profile]
    return record


def _worker(spec: dict[str, Any]) -> int:
    """Compiles one method for each block count, one result line per count on stdout."""
    import jax

    jax.config.update("jax_num_cpu_devices", spec["devices"])
    mesh = jax.make_mesh((spec["devices"],), (_AXIS,),
                         devices=jax.devices()[:spec["devices"]])

    def emit(record: dict[str, Any]) -> None:
        print(_MARK + json.dumps(record), flush=True)

    _lower_and_compile(mesh, spec["method"], 1, 8)  # warm-up: JAX's one-time costs
    emit({"ready": True})
    for blocks in spec["blocks"]:
        try:
            emit(_lower_and_compile(mesh, spec["method"], blocks, spec["width"],
                                    spec.get("runs", 0), spec.get("profile", 0)))
        except Exception as e:  # noqa: BLE001 - reported in the table, the worker goes on
            emit({"error": f"{type(e).__name__}: {e}"})
    return 0


def _worker_env(devices: int) -> dict[str, str]:
    """This environment on the CPU backend with ``devices`` simulated devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def _run_method(method: str, blocks: list[int], width: int, devices: int, timeout: float,
                on_result: Callable[[int, dict[str, Any]], None], runs: int = 0,
                profile: int = 0) -> None:
    """Runs one worker for ``method``; ``on_result(index, record)`` for each block count.

    A record is the worker's measurement, ``{"timeout": T}`` for the count
    whose lower + compile ran past ``timeout`` (the worker is killed; its
    start and warm-up may take ``max(timeout, 120)`` s),
    ``{"skipped": ...}`` for the larger counts after it, or ``{"error": ...}``.
    """
    spec = json.dumps({"method": method, "blocks": blocks, "width": width, "devices": devices,
                       "runs": runs, "profile": profile})
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "qcollect.bench.compile", "--worker", spec],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=_worker_env(devices))
        lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        stdout = proc.stdout
        assert stdout is not None  # stdout=PIPE

        def read() -> None:
            for line in stdout:
                if line.startswith(_MARK):
                    lines.put(json.loads(line[len(_MARK):]))
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()

        def next_record(limit: float = timeout) -> tuple[dict[str, Any], bool]:
            try:
                record = lines.get(timeout=limit)
            except queue.Empty:
                return {"timeout": limit}, True
            if record is None:  # the worker died (e.g. killed for memory)
                proc.wait()
                err.seek(0)
                tail = err.read()[-2000:].strip()
                return {"error": f"worker exited with {proc.returncode}: {tail}"}, True
            return record, False

        try:
            ready, fatal = next_record(max(timeout, _WARM_UP_S))
            if fatal:  # not even the warm-up compiled: nothing to measure
                if "timeout" in ready:
                    ready = {"error": f"start-up and warm-up compile ran past "
                                      f"{ready['timeout']:g} s"}
                for i in range(len(blocks)):
                    on_result(i, ready)
                return
            for i in range(len(blocks)):
                record, fatal = next_record()
                on_result(i, record)
                if fatal:  # larger sizes would take longer still
                    for j in range(i + 1, len(blocks)):
                        on_result(j, {"skipped": f"after {format_cell(record)} at a smaller size"})
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _progress(total: int) -> Any:
    """A tqdm progress bar over ``total`` programs, or None without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="compile", unit="program", file=sys.stderr,
                dynamic_ncols=True)


def run(targets: list[float], methods: list[str], width: int, devices: int,
        timeout: float, runs: int = 0, profile: int = 0) -> list[dict]:
    """One row per (size, method): sizes as ``--params`` targets in millions."""
    blocks = sorted(set(blocks_for(t, width) for t in targets))
    leaves = len(block_shapes(width))
    bar = _progress(len(blocks) * len(methods))
    rows = []
    for method in methods:
        if bar is not None:
            bar.set_postfix_str(method)

        def on_result(i: int, record: dict[str, Any], method: str = method) -> None:
            rows.append({"method": method, "blocks": blocks[i],
                         "parameters": blocks[i] * block_params(width),
                         "leaves": blocks[i] * leaves, "width": width, "devices": devices,
                         **record})
            if bar is not None:
                bar.update()
            else:
                print(f"compile: {method}, {rows[-1]['parameters']:,} parameters: "
                      f"{format_cell(record)}", file=sys.stderr, flush=True)

        _run_method(method, blocks, width, devices, timeout, on_result, runs, profile)
    if bar is not None:
        bar.close()
    return rows


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m qcollect.bench compile``."""
    p = argparse.ArgumentParser(prog="python -m qcollect.bench compile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default=DEFAULT_PARAMS,
                   help="comma-separated target sizes in millions of parameters "
                        f"(default {DEFAULT_PARAMS}); blocks = round(target / block size)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated METHOD or METHOD/ALGORITHM, METHOD one of "
                        f"{', '.join(METHODS)}, ALGORITHM one of ring, pairwise, "
                        f"ring_requantize; a suffix @B sets batch_buckets (@auto, @always, "
                        f"@never or an int K) (default {','.join(DEFAULT_METHODS)})")
    p.add_argument("--width", type=int, default=512,
                   help="model width d: blocks of d x d, d x 4d, 4d x d, d (default 512)")
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices (default 8)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds per lower + compile before it is killed (default 300)")
    p.add_argument("--runs", type=int, default=0,
                   help="also run each compiled program this many times on random "
                        "gradients (allocates them) and report the median step ms "
                        "(default 0: compile only)")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="with --runs: also profile each program and list its K operations "
                        "with the most device time (default 0: no profile)")
    p.add_argument("--out", default=None,
                   help="directory to write compile.md and compile.json to")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Compiles, prints and writes the tables (or, with ``--worker``, is one
    method's worker); 0, or 2 for a bad argument."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        return _worker(json.loads(args.worker))
    try:
        targets = [float(t) for t in args.params.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--params must be comma-separated numbers (millions), got {args.params!r}")
    if not targets or not all(np.isfinite(t) and t > 0 for t in targets):
        parser.error(f"--params must be positive numbers (millions), got {args.params!r}")
    if args.width < 1 or args.devices < 1 or not args.timeout > 0:
        parser.error("--width, --devices and --timeout must be positive")
    if args.runs < 0:
        parser.error(f"--runs must be 0 or more, got {args.runs}")
    if args.profile < 0 or (args.profile and not args.runs):
        parser.error(f"--profile must be 0 or more and needs --runs, got {args.profile}")
    methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    if not methods:
        parser.error("--methods names no method")
    for m in methods:
        try:
            parse_method(m, args.devices)
        except ValueError as e:
            parser.error(f"--methods: {e}")
    start = time.perf_counter()
    rows = run(targets, methods, args.width, args.devices, args.timeout, args.runs,
               args.profile)
    text = tables(rows, methods, args.devices)
    print(text, flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s in all)", file=sys.stderr, flush=True)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile.md").write_text(text + "\n")
        (out / "compile.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {out / 'compile.md'}, {out / 'compile.json'}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
