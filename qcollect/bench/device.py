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
   that much). This part
   needs the repository's ``examples/`` folder
   (`qcollect.bench.training.examples_dir`); without it, it is skipped.
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
(`qcollect.bench._timing.interleaved_medians`); each timed call dispatches
its program back to back and waits for the last, as many times as fit in
about 10 ms (at most ``--calls``), so that the dispatch latency of one call
(tens of microseconds, as long as a 64M-value kernel on a GPU) is spread
over them.

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
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

import qcollect as qc
from qcollect.bench._device_report import (
    ROUND_TRIP_TARGETS,
    STEP_OVERHEAD_TARGET,
    markdown,
    targets,
)
from qcollect.bench._timing import Call, interleaved_medians, time_once
from qcollect.bench.passes import bandwidths, stream_calls
from qcollect.bench.quantizers import COMPRESSORS, gradient_like

#: Example names that run other transforms, plans or phases (not one
#: compressor through `transforms.compressed_all_reduce`).
OTHER_TRANSFORMS = ("entropy", "powersgd", "gradiveq")
#: A timed call is repeated back to back up to about this long (`_medians`).
BATCH_SECONDS = 0.01
#: Prints a progress line.
Say = Callable[[str], None]


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


@dataclasses.dataclass
class Clock:
    """The run's time budget: `out` once ``budget`` seconds have passed
    since ``start``."""

    budget: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start

    def out(self) -> bool:
        """Whether the budget is spent."""
        return self.elapsed() > self.budget

    def why(self) -> str:
        """What a row skipped for time says."""
        return f"not measured: the run's {self.budget:g} s budget (--budget) was spent"


def _repeated(fn: Callable[..., Any], calls: int) -> Callable[..., Any]:
    """``fn`` dispatched ``calls`` times back to back; the last result."""

    def run(*args: Any) -> Any:
        out = fn(*args)
        for _ in range(calls - 1):
            out = fn(*args)
        return out

    return run


def _medians(timed: dict[str, Call], repeats: int, calls: int) -> dict[str, float]:
    """Median seconds of one call of each of ``timed``: each runs `_repeated`
    as many times as fit in `BATCH_SECONDS` (1 to ``calls``), once compiled."""
    counts = {}
    for name, (fn, args) in timed.items():
        jax.block_until_ready(fn(*args))
        once = time_once(fn, *args)
        counts[name] = max(1, min(calls, int(BATCH_SECONDS / max(once, 1e-9))))
    batched = {name: (_repeated(fn, counts[name]), args) for name, (fn, args) in timed.items()}
    return {name: s / counts[name] for name, s in interleaved_medians(batched, repeats).items()}


def _failure(err: BaseException) -> str:
    """One line saying what failed (a part's or a row's ``error``)."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def copy_bandwidth(x: jax.Array, repeats: int, calls: int) -> tuple[dict[str, float], str]:
    """Bytes per second of the STREAM read, copy and triad over arrays like
    ``x`` and ``"best"``, and how their bytes were counted: the compiled
    kernels' (`qcollect.bench.passes.bandwidths`), or, where the compiled
    program cannot be read, the bytes the kernels must move (4n, 8n, 12n)."""
    stream = stream_calls(x, x * 2)
    seconds = _medians(stream, repeats, calls)
    try:
        return bandwidths(stream, seconds), "bytes of the compiled kernels"
    except Exception:  # noqa: BLE001 - an unknown backend's HLO; the plain bytes hold
        must = {"read": 4, "copy": 8, "triad": 12}
        rates = {k: must[k] * x.size / seconds[f"stream {k}"] for k in must}
        return {**rates, "best": max(rates.values())}, "bytes the kernels must move"


def _round_trip_traffic(fn: Callable[..., Any], args: tuple[Any, ...], seconds: float,
                        copy: float) -> dict[str, Any]:
    """The compiled round trip's memory-touching kernels and their bytes
    (`qcollect.memory_report`), and that traffic's rate over ``copy``."""
    try:
        kernels = qc.memory_report(fn, *args)
    except Exception as err:  # noqa: BLE001 - the timings stand without it
        return {"round_trip_compiled_bytes": None, "round_trip_traffic_error": _failure(err)}
    moved = sum(k.traffic for k in kernels)
    return {"round_trip_kernels": len(kernels), "round_trip_compiled_bytes": moved,
            "round_trip_compiled_of_copy": moved / seconds / copy}


def codec_row(name: str, x: jax.Array, s: Setting, copy: float
              ) -> tuple[dict[str, Any], Call]:
    """Encode, decode and the round trip of compressor ``name`` on ``x``, as
    ms, GB/s of the bytes they must move and fractions of ``copy`` (bytes
    per second), with the compiled round trip's traffic; and the round trip
    as a call (for a profile)."""
    key = jax.random.key(1)
    n = x.size
    c = COMPRESSORS[name](x)
    encode, decode = jax.jit(c.encode), jax.jit(c.decode)
    payload = encode(x, key)
    round_trip = jax.jit(lambda x, k, c=c: x - c.round_trip(x, k)[1])
    seconds = _medians({"encode": (encode, (x, key)), "decode": (decode, (payload,)),
                        "round_trip": (round_trip, (x, key))}, s.repeats, s.calls)
    sent = qc.payload_bytes(payload)
    moved = {"encode": 4 * n + sent, "decode": sent + 4 * n, "round_trip": 8 * n}
    row: dict[str, Any] = {"compressor": name, "bits_per_element": 8 * sent / n}
    for part, count in moved.items():
        rate = count / seconds[part]
        row.update({f"{part}_ms": 1e3 * seconds[part], f"{part}_bytes": count,
                    f"{part}_gbs": rate / 1e9, f"{part}_of_copy": rate / copy})
    row.update(_round_trip_traffic(round_trip, (x, key), seconds["round_trip"], copy))
    return row, (round_trip, (x, key))


def profile_of(fn: Callable[..., Any], args: tuple[Any, ...], top: int) -> dict[str, Any]:
    """The ``top`` operations of a jitted call by device time
    (`qcollect.bench._profile.op_times`) and all operations' total, or
    what failed."""
    from qcollect.bench._profile import op_times

    try:
        ops = op_times(fn.lower(*args).compile(), args)  # type: ignore[attr-defined]
    except Exception as err:  # noqa: BLE001 - a profiler missing on the device
        return {"error": _failure(err)}
    return {"top": [list(op) for op in ops[:top]], "total_ms": sum(ms for _, ms in ops)}


def codec_rows(x: jax.Array, names: Sequence[str], s: Setting, copy: float, clock: Clock,
               say: Say) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """`codec_row` of each of ``names`` as it is measured, with the profile
    of its round trip when below its target (`_device_report.ROUND_TRIP_TARGETS`);
    a failing one says why and the rest still run; past the budget the
    rest are skipped."""
    for name in names:
        if clock.out():
            yield {"compressor": name, "skipped": clock.why()}, {}
            continue
        try:
            row, call = codec_row(name, x, s, copy)
        except Exception as err:  # noqa: BLE001 - one codec failing is itself a finding
            say(f"{name}: failed: {_failure(err)}")
            yield {"compressor": name, "error": _failure(err)}, {}
            continue
        profiles = {}
        if s.profile_top and row["round_trip_of_copy"] < ROUND_TRIP_TARGETS.get(name, 0.0):
            profiles[f"the {name} round trip"] = profile_of(*call, s.profile_top)
        say(f"{name}: encode {row['encode_gbs']:.1f} GB/s, decode {row['decode_gbs']:.1f} "
            f"GB/s, round trip {row['round_trip_gbs']:.1f} GB/s")
        yield row, profiles


def lm_names() -> list[str]:
    """``none``, ``local`` (no all-reduce: the step's compute alone) and
    every example name that runs one compressor through
    `transforms.compressed_all_reduce` (``common.config.COMPRESSOR_NAMES``
    but `OTHER_TRANSFORMS`), the targets' ``qsgd-4`` and ``onebit`` next;
    needs the examples on ``sys.path`` (`_examples`)."""
    from common.config import COMPRESSOR_NAMES, COMPUTE_ONLY

    names = [n for n in COMPRESSOR_NAMES if n not in OTHER_TRANSFORMS]
    first = ["none", COMPUTE_ONLY, *(n for n in ("qsgd-4", "onebit") if n in names)]
    return first + [n for n in names if n not in first]


def _examples() -> pathlib.Path:
    """The checkout's ``examples/`` folder, put on ``sys.path``
    (FileNotFoundError without one)."""
    from qcollect.bench.training import examples_dir

    folder = examples_dir()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder


def lm_steps(s: Setting, names: Sequence[str], clock: Clock, say: Say
             ) -> tuple[dict[str, Call], dict[str, str], int]:
    """The language model's compiled step on a one-device mesh per
    all-reduce of ``names`` (``none`` first), what was not compiled and
    why (a failure, the time budget), and the model's parameter count."""
    _examples()
    import optax
    from common.train import DataParallel, make_optimizer
    from lm.config import Config
    from lm.model import build

    cfg = Config(width=s.width, depth=s.depth, heads=s.heads, context=s.context,
                 batch_size=s.batch, compressors=("none",))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    dp = DataParallel(build(cfg), mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                            make_optimizer(cfg, weight_decay=cfg.weight_decay))
    windows = np.random.default_rng(0).integers(0, 256, (s.batch, s.context + 1), np.int32)
    x, y = dp.batch(windows[:, :-1], windows[:, 1:])
    params = dp.place(dp.params)
    steps: dict[str, Call] = {}
    missing: dict[str, str] = {}
    for name in ["none", *(n for n in names if n != "none")]:
        if clock.out() and name != "none":
            missing[name] = clock.why()
            continue
        try:
            comm = dp.communication(name, cfg, jax.random.key(cfg.seed))
            tx = dp.transformation(comm, optimizer)
            state = dp.init(tx, params)
            step = dp.step(tx, state, replicated=comm.replicated)
            jax.block_until_ready(step(params, state, x, y))
        except Exception as err:  # noqa: BLE001 - the other rows still measure
            missing[name] = f"failed: {_failure(err)}"
            continue
        steps[name] = (step, (params, state, x, y))
        say(f"compiled the step with {name}")
    return steps, missing, sum(leaf.size for leaf in jax.tree.leaves(dp.params))


def lm_rows(s: Setting, names: Sequence[str], clock: Clock, say: Say) -> dict[str, Any]:
    """Median step ms of the language model per all-reduce of ``names``,
    its ratio to ``none``'s, what was not measured and why, and the
    profiles of ``none`` and of the two slowest steps over the target
    (`_device_report.STEP_OVERHEAD_TARGET`)."""
    steps, missing, count = lm_steps(s, names, clock, say)
    if "none" not in steps:
        raise RuntimeError(f"the step with none did not compile: {missing.get('none')}")
    seconds = _medians(steps, s.repeats, s.calls)
    say("timed the steps: " + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in seconds.items()))
    rows: list[dict[str, Any]] = [
        {"all_reduce": name, "parameters": count, "step_ms": 1e3 * t,
         "overhead_vs_none": t / seconds["none"]} for name, t in seconds.items()]
    over = sorted((name for name, t in seconds.items()
                   if t / seconds["none"] > STEP_OVERHEAD_TARGET),
                  key=lambda name: -seconds[name])[:2]
    profiles = {}
    if s.profile_top and over:
        for name in ["none", *over]:
            profiles[f"the step with {name}"] = profile_of(*steps[name], s.profile_top)
    return {"rows": rows, "not_measured": missing, "profiles": profiles}


def network_rows(mib: float, repeats: int, calls: int, methods: Sequence[str] | None = None
                 ) -> list[dict[str, Any]]:
    """The network benchmark's methods (``psum`` first) over every device of
    this process: median ms, speedup over ``psum``, wire bytes per device."""
    from qcollect.bench import _network
    from qcollect.bench.network import METHODS

    mesh = _network.meshes()[0]
    n = mesh.size
    size = _network._values(mib)
    x = _network._buffers(size, mesh)
    chosen = ["psum", *(m for m in (methods or METHODS) if m != "psum")]
    timed: dict[str, Call] = {
        m: (_network._mapped(_network._reducer(m, size, n), mesh), (x,)) for m in chosen}
    seconds = _medians(timed, repeats, calls)
    return [{"method": m, "devices": n, "mib": mib, "median_ms": 1e3 * seconds[m],
             "speedup_vs_psum": seconds["psum"] / seconds[m],
             "wire_bytes": qc.wire_bytes(fn, *args)} for m, (fn, args) in timed.items()]


def _lm_part(s: Setting, names: Sequence[str], clock: Clock, say: Say) -> dict[str, Any]:
    """The language model's rows, or why they were skipped."""
    setting = {"width": s.width, "depth": s.depth, "heads": s.heads, "context": s.context,
               "batch": s.batch}
    try:
        _examples()
    except FileNotFoundError as err:
        return {"setting": setting, "rows": [], "skipped": str(err)}
    if clock.out():
        return {"setting": setting, "rows": [], "skipped": clock.why()}
    return {"setting": setting, **lm_rows(s, names, clock, say)}


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
        result[part] = {"rows": [], "skipped": f"failed: {_failure(err)}"}


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
    for row, profiles in codec_rows(x, names, s, rates["copy"], clock, say):
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
    try:
        return _examples() / "results" / "device"
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
    try:
        _examples()
        known = lm_names()
    except FileNotFoundError:  # no checkout: the model's part is skipped
        known = []
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
