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
   fraction of 1.0 moves those bytes as fast as the device copies an array;
   the bytes the compiled kernels really move are the quantizer
   benchmark's (its memory-floor columns, `qcollect.memory_bytes`).
3. the language model's training step (``examples/lm``: the GPT at width
   512, depth 8, 8 heads, context 256, 16 windows a step; ``--quick``: a
   tiny one) on a one-device mesh: the examples' own step
   (``common.train.DataParallel.step``: gradients, all-reduce, clip by
   global norm, AdamW) with the all-reduce ``none`` and each example name
   that runs `transforms.compressed_all_reduce` with one compressor. With
   one device the exchange is empty, so the step's time over ``none``'s is
   what the codec (encode, decode, error feedback) costs inside a real
   step, bounded, like the codecs alone, by the bytes it moves. This part
   needs the repository's ``examples/`` folder
   (`qcollect.bench.training.examples_dir`); without it, it is skipped.
4. with more than one device on an accelerator platform, the network
   benchmark's methods (`qcollect.bench._network`: ``psum``, the ring and
   the compressed all-reduces) over every device of this process on
   ``--network-mib`` MiB per device; otherwise skipped, and the files say
   why (``python -m qcollect.bench network`` measures CPU processes over a
   shaped network).

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
``jax.default_backend()``, e.g. ``gpu``, ``cpu``) or of ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import qcollect as qc
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


QUICK = Setting(rows=256, cols=256, stream_values=1 << 22, width=32, depth=1, heads=2,
                context=16, batch=2, repeats=3, calls=2)
#: The all-reduces of the language model's rows in ``--quick`` (compiling a
#: step on a CPU takes seconds).
QUICK_LM = ("none", "qsgd-4")


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


def copy_bandwidth(x: jax.Array, repeats: int, calls: int) -> dict[str, float]:
    """Bytes per second of the STREAM read, copy and triad over arrays like
    ``x`` (`qcollect.bench.passes.bandwidths`), and ``"best"``."""
    stream = stream_calls(x, x * 2)
    return bandwidths(stream, _medians(stream, repeats, calls))


def codec_rows(x: jax.Array, names: Sequence[str], repeats: int, calls: int, copy: float,
               say: Say) -> list[dict[str, Any]]:
    """One row per compressor of ``names``: encode, decode and the round trip
    on ``x``, as ms, GB/s of the bytes they must move and fractions of
    ``copy`` (bytes per second)."""
    key = jax.random.key(1)
    n = x.size
    rows = []
    for name in names:
        c = COMPRESSORS[name](x)
        encode, decode = jax.jit(c.encode), jax.jit(c.decode)
        payload = encode(x, key)
        round_trip = jax.jit(lambda x, k, c=c: x - c.round_trip(x, k)[1])
        seconds = _medians({"encode": (encode, (x, key)), "decode": (decode, (payload,)),
                            "round_trip": (round_trip, (x, key))}, repeats, calls)
        sent = qc.payload_bytes(payload)
        moved = {"encode": 4 * n + sent, "decode": sent + 4 * n, "round_trip": 8 * n}
        row: dict[str, Any] = {"compressor": name, "bits_per_element": 8 * sent / n}
        for part, count in moved.items():
            rate = count / seconds[part]
            row.update({f"{part}_ms": 1e3 * seconds[part], f"{part}_bytes": count,
                        f"{part}_gbs": rate / 1e9, f"{part}_of_copy": rate / copy})
        rows.append(row)
        say(f"{name}: encode {row['encode_gbs']:.1f} GB/s, decode {row['decode_gbs']:.1f} "
            f"GB/s, round trip {row['round_trip_gbs']:.1f} GB/s")
    return rows


def lm_names() -> list[str]:
    """``none`` and every example name that runs one compressor through
    `transforms.compressed_all_reduce` (``common.config.COMPRESSOR_NAMES``
    but `OTHER_TRANSFORMS`); needs the examples on ``sys.path`` (`_examples`)."""
    from common.config import COMPRESSOR_NAMES

    return [n for n in COMPRESSOR_NAMES if n not in OTHER_TRANSFORMS]


def _examples() -> pathlib.Path:
    """The checkout's ``examples/`` folder, put on ``sys.path``
    (FileNotFoundError without one)."""
    from qcollect.bench.training import examples_dir

    folder = examples_dir()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder


def lm_rows(s: Setting, names: Sequence[str], say: Say) -> list[dict[str, Any]]:
    """Median step ms of the language model on a one-device mesh per
    all-reduce of ``names`` (``none`` first), and its ratio to ``none``'s."""
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
    for name in ["none", *(n for n in names if n != "none")]:
        comm = dp.communication(name, cfg, jax.random.key(cfg.seed))
        tx = dp.transformation(comm, optimizer)
        state = dp.init(tx, params)
        step = dp.step(tx, state, replicated=comm.replicated)
        jax.block_until_ready(step(params, state, x, y))
        steps[name] = (step, (params, state, x, y))
        say(f"compiled the step with {name}")
    seconds = _medians(steps, s.repeats, s.calls)
    count = sum(leaf.size for leaf in jax.tree.leaves(dp.params))
    return [{"all_reduce": name, "parameters": count, "step_ms": 1e3 * t,
             "overhead_vs_none": t / seconds["none"]} for name, t in seconds.items()]


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


def _lm_part(s: Setting, names: Sequence[str], say: Say) -> dict[str, Any]:
    """The language model's rows, or why they were skipped."""
    setting = {"width": s.width, "depth": s.depth, "heads": s.heads, "context": s.context,
               "batch": s.batch}
    try:
        _examples()
    except FileNotFoundError as err:
        return {"setting": setting, "rows": [], "skipped": str(err)}
    return {"setting": setting, "rows": lm_rows(s, names, say)}


def _network_part(mib: float, s: Setting) -> dict[str, Any]:
    """The network rows on an accelerator with several devices, or why not."""
    platform, n = jax.default_backend(), len(jax.devices())
    if platform == "cpu" or n < 2:
        why = (f"only one {platform} device is present" if n < 2 else
               f"the {n} devices are CPU devices of one process; python -m qcollect.bench "
               "network measures CPU processes over a network")
        return {"rows": [], "skipped": why}
    return {"rows": network_rows(mib, s.repeats, s.calls)}


def run(s: Setting, names: Sequence[str], lm: Sequence[str], mib: float,
        say: Say) -> dict[str, Any]:
    """Every part of the benchmark (module docstring) as one JSON-ready dict."""
    start = time.perf_counter()
    device = jax.devices()[0]
    x = gradient_like(s.rows * s.cols)
    big = x if s.stream_values == x.size else gradient_like(s.stream_values)
    rates = copy_bandwidth(big, s.repeats, s.calls)
    del big
    say(f"copy bandwidth {rates['copy'] / 1e9:.1f} GB/s")
    return {
        "platform": jax.default_backend(), "device": device.device_kind,
        "devices": len(jax.devices()), "jax": jax.__version__, "setting": dataclasses.asdict(s),
        "values": int(x.size), "shape": list(x.shape), "stream_values": s.stream_values,
        "bandwidth_gbs": {k: v / 1e9 for k, v in rates.items()},
        "copy_gbs": rates["copy"] / 1e9,
        "compressors": codec_rows(x, names, s.repeats, s.calls, rates["copy"], say),
        "lm": _lm_part(s, lm, say),
        "network": _network_part(mib, s),
        "seconds": time.perf_counter() - start,
    }


def _codec_table(r: dict[str, Any]) -> list[str]:
    """The compressors' table."""
    lines = ["| compressor | bits/elem | encode ms | GB/s | of copy | decode ms | GB/s "
             "| of copy | EF round trip ms | GB/s | of copy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in r["compressors"]:
        cells = [f"{c['bits_per_element']:.3f}"]
        for part in ("encode", "decode", "round_trip"):
            cells += [f"{c[part + '_ms']:.3f}", f"{c[part + '_gbs']:.1f}",
                      f"{c[part + '_of_copy']:.2f}"]
        lines.append(f"| {c['compressor']} | " + " | ".join(cells) + " |")
    return lines


def _lm_table(lm: dict[str, Any]) -> list[str]:
    """The language model's table, or why it was skipped."""
    if not lm["rows"]:
        return [f"Skipped: {lm['skipped']}"]
    g = lm["setting"]
    lines = [f"GPT {g['depth']} x {g['width']} ({g['heads']} heads, context {g['context']}, "
             f"{g['batch']} windows a step, {lm['rows'][0]['parameters']:,} parameters) "
             "on a one-device mesh:", "",
             "| all-reduce | step ms | step / none |", "|---|---:|---:|"]
    lines += [f"| {r['all_reduce']} | {r['step_ms']:.2f} | {r['overhead_vs_none']:.3f} |"
              for r in lm["rows"]]
    return lines


def _network_table(net: dict[str, Any]) -> list[str]:
    """The network rows, or why they were skipped."""
    if not net["rows"]:
        return [f"Skipped: {net['skipped']}."]
    lines = ["| method | devices | MiB / device | median ms | speedup vs psum | wire bytes |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['devices']} | {r['mib']:g} | {r['median_ms']:.3f} "
              f"| {r['speedup_vs_psum']:.2f} | {r['wire_bytes']:,} |" for r in net["rows"]]
    return lines


def markdown(r: dict[str, Any]) -> str:
    """The report of `run`'s result."""
    s = r["setting"]
    bw = r["bandwidth_gbs"]
    head = [f"# Device benchmark: {r['platform']} ({r['device']}, {r['devices']} device(s), "
            f"jax {r['jax']})", "",
            f"Medians of {s['repeats']} interleaved repetitions of up to {s['calls']} "
            f"back-to-back calls; {r['seconds']:.0f} s in all.", "",
            f"Memory bandwidth over {r['stream_values']:,} float32 values (STREAM kernels, "
            f"bytes of the compiled kernels): copy **{bw['copy']:.1f} GB/s**, read "
            f"{bw['read']:.1f} GB/s, triad {bw['triad']:.1f} GB/s.", "",
            f"## Codecs on a {r['shape'][0]} x {r['shape'][1]} float32 matrix", "",
            "GB/s: the bytes each call must move over its median time: encode reads the "
            "float32 input and writes the payload, decode the reverse, the error-feedback "
            "round trip `x - round_trip(x)` reads the input and writes the residual (2x the "
            "input). `of copy`: that rate over the copy bandwidth.", ""]
    return "\n".join(head + _codec_table(r) + ["", "## Language-model step", ""]
                     + _lm_table(r["lm"]) + ["", "## All-reduce across devices", ""]
                     + _network_table(r["network"])) + "\n"


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
                        "none and qsgd-4")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="writes DIR/<platform>/device.{md,json} "
                        "(default: the checkout's examples/results/device)")
    p.add_argument("--only", nargs="*", default=None, metavar="NAME",
                   help="compressors to run (substring match); default all")
    p.add_argument("--lm", default=None,
                   help="comma-separated all-reduces of the model's step (default: none and "
                        "every one compressor name of the examples)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions")
    p.add_argument("--calls", type=int, default=None, help="most back-to-back calls per timing")
    p.add_argument("--network-mib", type=float, default=64.0,
                   help="MiB per device of the all-reduce across devices (default 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Measures, prints the tables and writes the files; 0, or 2 for a bad argument."""
    parser = _parser()
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Setting()
    s = dataclasses.replace(s, repeats=args.repeats or s.repeats, calls=args.calls or s.calls)
    if s.repeats < 1 or s.calls < 1 or not args.network_mib > 0:
        parser.error("--repeats and --calls must be >= 1 and --network-mib > 0")
    names = [n for n in COMPRESSORS if not args.only or any(o in n for o in args.only)]
    if not names:
        parser.error(f"--only matched none of: {', '.join(COMPRESSORS)}")
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
    bar = _progress(1 + len(names) + len(lm))

    def say(line: str) -> None:
        if bar is None:
            print(line, flush=True)
            return
        bar.update(1)
        bar.write(line)

    result = run(s, names, lm, args.network_mib, say)
    if bar is not None:
        bar.close()
    folder.mkdir(parents=True, exist_ok=True)
    text = markdown(result)
    (folder / "device.md").write_text(text)
    with open(folder / "device.json", "w") as f:
        json.dump(result, f, indent=1)
    print(text + f"wrote {folder / 'device.md'} and {folder / 'device.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
