"""Device benchmark: the codecs and a training step on this machine's accelerator.

``python -m qcollect.bench device`` measures, on the device JAX uses
(``jax.default_backend()``: a GPU when one is present; it runs on CPU too),
in one run:

1. the copy bandwidth: the STREAM kernels of `qcollect.bench.passes` (a
   read, a copy ``a + 1`` and a triad ``a + 1.5 b``) over 64M float32
   values (the codecs' array, larger than a GPU's caches; ``--quick``: 4M),
   bytes read and written by the compiled kernels
   (`qcollect.memory_bytes`) over their median time. The copy's rate is the
   reference of every fraction below: on a GPU each figure of this
   benchmark is bounded by memory bandwidth, not by arithmetic.
2. per compressor of the quantizer benchmark
   (`qcollect.bench.quantizers.COMPRESSORS`), on a gradient-like 8192 x 8192
   float32 matrix (64M values; ``--quick``: 256 x 256): ``encode``,
   ``decode`` and the error-feedback round trip ``x - round_trip(x)``
   (`Compressor.round_trip`, compiled as one program, as a training step
   computes the residual), each as median ms, GB/s and fraction of the copy
   bandwidth. GB/s counts the bytes each call must move at least: encode
   reads the float32 input and writes the payload (``4 n + payload``
   bytes), decode reads the payload and writes ``4 n``, the round trip
   reads the input and writes the residual (``8 n``: twice the input). A
   fraction of 1.0 moves those bytes as fast as the device copies an array.
   Beside them, the compiled round trip's memory-touching kernels and the
   bytes they really read and write (`qcollect.memory_report`), so that a
   slow round trip shows whether it moves too many bytes or moves them
   slowly.
3. the language model's training step (``examples/lm``: the GPT at width
   512, depth 8, 8 heads, context 256, 16 windows a step; ``--quick``: a
   tiny one) on a one-device mesh: the examples' own step
   (``common.train.DataParallel.step``: gradients, all-reduce, clip by
   global norm, AdamW) with the all-reduce ``none``, with none at all
   (``local``: the step's compute alone), and with each example name that
   runs `transforms.compressed_all_reduce` with one compressor. With one
   device the exchange is empty, so the step's time over ``none``'s is
   what the codec (encode, decode, error feedback) costs inside a real
   step, bounded, like the codecs alone, by the bytes it moves; ``local``
   shows what ``none``'s all-reduce of one device still costs (XLA:CPU
   runs it as a copy of the gradients; the ratios to ``none`` are low by
   that much). The step is Flax and optax code, so this part is an example
   program of the checkout, ``examples/lm/step_time.py``, run as a
   subprocess on the same device (`qcollect.bench._device_lm`; found by
   its path in the examples folder, `qcollect.bench.training.examples_dir`,
   never imported); without the folder it is skipped and says so.
4. with more than one device on an accelerator platform, the network
   benchmark's methods (`qcollect.bench._network`: ``psum``, the ring and
   the compressed all-reduces) over every device of this process on
   ``--network-mib`` MiB per device; otherwise skipped, and the files say
   why (``python -m qcollect.bench network`` measures CPU processes over a
   shaped network).

5. the targets a GPU should meet (`qcollect.bench._device_report.targets`:
   the 1-bit and 4-bit round trips at half the copy bandwidth, every step at
   most 10 % over ``none``'s) and, for each program that misses one, its
   profile (`qcollect.bench._profile.op_times`: device time per operation
   of the compiled program, ``--profile-top`` of them; with the step's,
   ``none``'s for reference).

Times are medians of ``--repeats`` interleaved repetitions
(`qcollect.bench.device_timing.medians`); each timed call dispatches
its program back to back and waits for the last, as many times as fit in
about 10 ms (at most ``--calls``), so that the dispatch latency of one call
(tens of microseconds, as long as a 64M-value kernel on a GPU) is spread
over them. Parts 1 and 2 are `qcollect.bench._device_codecs`'s.

Run it on the GPU machine as it is::

    python -m qcollect.bench device                  # examples/results/device/gpu/
    python -m qcollect.bench device --out DIR        # DIR/<platform>/device.{md,json}
    python -m qcollect.bench device --quick          # small sizes, a tiny model (tests)

never with ``JAX_PLATFORMS=cpu`` there (it would measure the host). It
writes ``device.md`` and ``device.json`` into
``examples/results/device/<platform>/`` of the checkout (``<platform>``:
``jax.default_backend()``, e.g. ``gpu``, ``cpu``) or of ``--out``, after
each compressor and each part, so that a run stopped from outside leaves
what it measured (``"complete": false``). Rows not started within
``--budget`` seconds (default 360, which leaves the rows started before
it and the profiles time to end within the 8 minutes a run should take)
are skipped and say so; a compressor or a part that fails says why in
its place and the rest still run: one run on a machine lent for minutes
returns every figure it can.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

import qcollect as qc
from qcollect.bench._device_codecs import codec_rows, copy_bandwidth
from qcollect.bench._device_lm import MODEL, lm_names, lm_part
from qcollect.bench._device_report import ROUND_TRIP_TARGETS, markdown, targets
from qcollect.bench.device_timing import Call, Clock, Say, failure, medians, profile_of
from qcollect.bench.quantizers import COMPRESSORS, gradient_like

__all__ = ["QUICK", "QUICK_LM", "Setting", "main", "network_rows", "profile_of", "run"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """What one run measures: the codec array, the bandwidth's array, the
    model, the timing."""

    rows: int = 8192
    cols: int = 8192
    stream_values: int = 8192 * 8192
    width: int = 512
    depth: int = 8
    heads: int = 8
    context: int = 256
    batch: int = 16
    repeats: int = 9
    calls: int = 10
    budget: float = 360.0
    profile_top: int = 8


QUICK = Setting(rows=256, cols=256, stream_values=1 << 22, width=32, depth=1, heads=2,
                context=16, batch=2, repeats=3, calls=2, budget=3600.0, profile_top=4)
#: The all-reduces of the language model's rows in ``--quick`` (compiling a
#: step on a CPU takes seconds).
QUICK_LM = ("none", "local", "qsgd-4")


def network_rows(mib: float, repeats: int, calls: int, methods: Sequence[str] | None = None
                 ) -> list[dict[str, Any]]:
    """The network benchmark's methods (``psum`` first) over every device of
    this process: median ms, speedup over ``psum``, wire bytes per device."""
    from qcollect.bench._network import buffer_values, buffers, mapped, meshes, reducer
    from qcollect.bench.network import METHODS

    mesh = meshes()[0]
    n = mesh.size
    size = buffer_values(mib)
    x = buffers(size, mesh)
    chosen = ["psum", *(m for m in (methods or METHODS) if m != "psum")]
    timed: dict[str, Call] = {m: (mapped(reducer(m, size, n), mesh), (x,)) for m in chosen}
    seconds = medians(timed, repeats, calls)
    return [{"method": m, "devices": n, "mib": mib, "median_ms": 1e3 * seconds[m],
             "speedup_vs_psum": seconds["psum"] / seconds[m],
             "wire_bytes": qc.wire_bytes(fn, *args)} for m, (fn, args) in timed.items()]


def _lm_part(s: Setting, names: Sequence[str], clock: Clock, say: Say) -> dict[str, Any]:
    """The language model's rows, or why they were skipped
    (`qcollect.bench._device_lm`: an example program, run as a subprocess)."""
    return lm_part({k: getattr(s, k) for k in MODEL}, names, clock, say, repeats=s.repeats,
                   calls=s.calls, profile_top=s.profile_top)


def _network_part(mib: float, s: Setting, clock: Clock) -> dict[str, Any]:
    """The network rows on an accelerator with several devices, or why not."""
    platform, n = jax.default_backend(), len(jax.devices())
    if platform == "cpu" or n < 2:
        why = (f"only one {platform} device is present" if n < 2 else
               f"the {n} devices are CPU devices of one process; python -m qcollect.bench "
               "network measures CPU processes over a network")
        return {"rows": [], "skipped": why}
    if clock.out():
        return {"rows": [], "skipped": clock.why()}
    return {"rows": network_rows(mib, s.repeats, s.calls)}


def _guarded(result: dict[str, Any], part: str, fn: Callable[[], Any]) -> None:
    """``result[part] = fn()``; a part that fails says why in its place."""
    try:
        result[part] = fn()
    except Exception as err:  # noqa: BLE001 - the other parts are still worth writing
        result[part] = {"rows": [], "skipped": f"failed: {failure(err)}"}


def run(s: Setting, names: Sequence[str], lm: Sequence[str], mib: float, say: Say,
        save: Callable[[dict[str, Any]], None] = lambda r: None) -> dict[str, Any]:
    """Every part of the benchmark (module docstring) as one JSON-ready dict,
    passed to ``save`` after each part, so that a run stopped from outside
    leaves what it measured (``complete`` is False until the end)."""
    clock = Clock(s.budget)
    device = jax.devices()[0]
    r: dict[str, Any] = {
        "platform": jax.default_backend(), "device": device.device_kind,
        "devices": len(jax.devices()), "jax": jax.__version__, "setting": dataclasses.asdict(s),
        "complete": False, "seconds": 0.0}
    x = gradient_like(s.rows * s.cols)
    big = x if s.stream_values == x.size else gradient_like(s.stream_values)
    rates, counted = copy_bandwidth(big, s.repeats, s.calls)
    del big
    say(f"copy bandwidth {rates['copy'] / 1e9:.1f} GB/s")
    r.update({"values": int(x.size), "shape": list(x.shape), "stream_values": s.stream_values,
              "bandwidth_gbs": {k: v / 1e9 for k, v in rates.items()},
              "bandwidth_bytes": counted, "copy_gbs": rates["copy"] / 1e9})
    r.update(compressors=[], profiles={})
    for row, profiles in codec_rows(x, names, rates["copy"], clock, say, repeats=s.repeats,
                                    calls=s.calls, profile_top=s.profile_top):
        r["compressors"].append(row)
        r["profiles"].update(profiles)
        r["seconds"] = clock.elapsed()
        save(r)
    del x
    for part, fn in (("lm", lambda: _lm_part(s, lm, clock, say)),
                     ("network", lambda: _network_part(mib, s, clock))):
        r["seconds"] = clock.elapsed()
        save(r)
        _guarded(r, part, fn)
    r["profiles"].update(r["lm"].pop("profiles", {}))
    r.update(targets=targets(r), complete=True, seconds=clock.elapsed())
    save(r)
    return r


def _default_out() -> pathlib.Path:
    """``examples/results/device`` of the checkout (of the working directory without one)."""
    from qcollect.bench.training import examples_dir

    try:
        return examples_dir() / "results" / "device"
    except FileNotFoundError:
        return pathlib.Path("examples") / "results" / "device"


def _progress(total: int) -> Any:
    """A tqdm progress bar over ``total`` measurements, or None without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="device", unit="row", file=sys.stderr, dynamic_ncols=True)


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m qcollect.bench device``."""
    p = argparse.ArgumentParser(prog="python -m qcollect.bench device",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="256 x 256 values, the bandwidth over 4M, a tiny model, all-reduces "
                        f"{', '.join(QUICK_LM)}")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="writes DIR/<platform>/device.{md,json} "
                        "(default: the checkout's examples/results/device)")
    p.add_argument("--only", nargs="*", default=None, metavar="NAME",
                   help="compressors to run (substring match); default all")
    p.add_argument("--lm", default=None,
                   help="comma-separated all-reduces of the model's step (default: none, "
                        "local and every one compressor name of the examples)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions")
    p.add_argument("--calls", type=int, default=None, help="most back-to-back calls per timing")
    p.add_argument("--network-mib", type=float, default=64.0,
                   help="MiB per device of the all-reduce across devices (default 64)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="seconds after which the rows not yet started are skipped, each "
                        "saying so (default 360; --quick: 3600)")
    p.add_argument("--profile-top", type=int, default=None, metavar="K",
                   help="operations listed per profile of a program that misses its target "
                        "(default 8; --quick: 4; 0: no profiles)")
    return p


def _writer(folder: pathlib.Path) -> Callable[[dict[str, Any]], None]:
    """Writes a result as ``folder/device.{md,json}``, the JSON replaced at once."""

    def save(result: dict[str, Any]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "device.md").write_text(markdown(result))
        part = folder / "device.json.part"
        part.write_text(json.dumps(result, indent=1))
        part.replace(folder / "device.json")

    return save


def main(argv: list[str] | None = None) -> int:
    """Measures, prints the tables and writes the files; 0, or 2 for a bad argument."""
    parser = _parser()
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Setting()
    s = dataclasses.replace(
        s, repeats=args.repeats or s.repeats, calls=args.calls or s.calls,
        budget=s.budget if args.budget is None else args.budget,
        profile_top=s.profile_top if args.profile_top is None else args.profile_top)
    if s.repeats < 1 or s.calls < 1 or not args.network_mib > 0:
        parser.error("--repeats and --calls must be >= 1 and --network-mib > 0")
    if not s.budget > 0 or s.profile_top < 0:
        parser.error("--budget must be > 0 and --profile-top >= 0")
    names = [n for n in COMPRESSORS if not args.only or any(o in n for o in args.only)]
    if not names:
        parser.error(f"--only matched none of: {', '.join(COMPRESSORS)}")
    names.sort(key=lambda n: n not in ROUND_TRIP_TARGETS)  # the targets' first
    known = lm_names()  # none without a checkout: the model's part is skipped
    lm = ([v.strip() for v in args.lm.split(",") if v.strip()] if args.lm
          else list(QUICK_LM) if args.quick else known)
    if known and not set(lm) <= set(known):
        parser.error(f"--lm must name some of {', '.join(known)}, got {lm}")
    lm = ["none", *(n for n in lm if n != "none")]
    folder = (pathlib.Path(args.out) if args.out else _default_out()) / jax.default_backend()
    bar = _progress(1 + len(names) + len(lm) + 1)  # the bandwidth, rows, steps' timing

    def say(line: str) -> None:
        if bar is None:
            print(line, flush=True)
            return
        bar.update(1)
        bar.write(line)

    result = run(s, names, lm, args.network_mib, say, _writer(folder))
    if bar is not None:
        bar.close()
    print(markdown(result) + f"wrote {folder / 'device.md'} and {folder / 'device.json'}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
