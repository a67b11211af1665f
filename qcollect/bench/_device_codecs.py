"""The device benchmark's first two parts: the copy bandwidth and the codecs.

`copy_bandwidth` is the reference rate of every fraction of the report (the
STREAM kernels of `qcollect.bench.passes`); `codec_rows` measures each
compressor's encode, decode and error-feedback round trip against it, as
`qcollect.bench.device` describes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

import qcollect as qc
from qcollect.bench._device_report import ROUND_TRIP_TARGETS
from qcollect.bench.device_timing import Call, Clock, Say, failure, medians, profile_of
from qcollect.bench.passes import bandwidths, stream_calls
from qcollect.bench.quantizers import COMPRESSORS


def copy_bandwidth(x: jax.Array, repeats: int, calls: int) -> tuple[dict[str, float], str]:
    """Bytes per second of the STREAM read, copy and triad over arrays like
    ``x`` and ``"best"``, and how their bytes were counted: the compiled
    kernels' (`qcollect.bench.passes.bandwidths`), or, where the compiled
    program cannot be read, the bytes the kernels must move (4n, 8n, 12n)."""
    stream = stream_calls(x, x * 2)
    seconds = medians(stream, repeats, calls)
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
        return {"round_trip_compiled_bytes": None, "round_trip_traffic_error": failure(err)}
    moved = sum(k.traffic for k in kernels)
    return {"round_trip_kernels": len(kernels), "round_trip_compiled_bytes": moved,
            "round_trip_compiled_of_copy": moved / seconds / copy}


def codec_row(name: str, x: jax.Array, copy: float, *, repeats: int, calls: int
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
    seconds = medians({"encode": (encode, (x, key)), "decode": (decode, (payload,)),
                       "round_trip": (round_trip, (x, key))}, repeats, calls)
    sent = qc.payload_bytes(payload)
    moved = {"encode": 4 * n + sent, "decode": sent + 4 * n, "round_trip": 8 * n}
    row: dict[str, Any] = {"compressor": name, "bits_per_element": 8 * sent / n}
    for part, count in moved.items():
        rate = count / seconds[part]
        row.update({f"{part}_ms": 1e3 * seconds[part], f"{part}_bytes": count,
                    f"{part}_gbs": rate / 1e9, f"{part}_of_copy": rate / copy})
    row.update(_round_trip_traffic(round_trip, (x, key), seconds["round_trip"], copy))
    return row, (round_trip, (x, key))


def codec_rows(x: jax.Array, names: Sequence[str], copy: float, clock: Clock, say: Say, *,
               repeats: int, calls: int, profile_top: int
               ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """`codec_row` of each of ``names`` as it is measured, with the profile
    of its round trip (``profile_top`` operations; 0: none) when below its
    target (`_device_report.ROUND_TRIP_TARGETS`); a failing one says why
    and the rest still run; past the budget the rest are skipped."""
    for name in names:
        if clock.out():
            yield {"compressor": name, "skipped": clock.why()}, {}
            continue
        try:
            row, call = codec_row(name, x, copy, repeats=repeats, calls=calls)
        except Exception as err:  # noqa: BLE001 - one codec failing is itself a finding
            say(f"{name}: failed: {failure(err)}")
            yield {"compressor": name, "error": failure(err)}, {}
            continue
        profiles = {}
        if profile_top and row["round_trip_of_copy"] < ROUND_TRIP_TARGETS.get(name, 0.0):
            profiles[f"the {name} round trip"] = profile_of(*call, profile_top)
        say(f"{name}: encode {row['encode_gbs']:.1f} GB/s, decode {row['decode_gbs']:.1f} "
            f"GB/s, round trip {row['round_trip_gbs']:.1f} GB/s")
        yield row, profiles
