"""The device benchmark's targets and its markdown report (`qcollect.bench.device`).

`targets` judges a result against what a GPU should reach: the 1-bit and
4-bit error-feedback round trips at half the copy bandwidth or more (a
memory-bound codec that moves twice its input; published quantization
kernels reach 70-75 % of a GPU's bandwidth), and every compressor's
language-model step at most 10 % over the uncompressed one. `markdown`
writes the report of a result, complete or not: a run stopped by its time
budget or by a failing part still says what it measured.
"""

from __future__ import annotations

from typing import Any

from qcollect.bench._profile import profile_table

#: Error-feedback round trips that should reach this fraction of the copy
#: bandwidth, by the quantizer benchmark's compressor names.
ROUND_TRIP_TARGETS = {"onebit (bucket 64)": 0.5, "qsgd-4 (bucket 512)": 0.5}
#: The most a compressor's language-model step may take over ``none``'s.
STEP_OVERHEAD_TARGET = 1.10
#: The language model's steps that are references, not compressors: the
#: uncompressed all-reduce and no all-reduce at all (the compute alone).
REFERENCE_STEPS = ("none", "local")


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: what it asks, the measured value (None when not
    measured) and whether it is met.

    Example:
      >>> r = {"compressors": [{"compressor": "qsgd-4 (bucket 512)", "round_trip_of_copy": 0.6}],
      ...      "lm": {"rows": [{"all_reduce": "none", "overhead_vs_none": 1.0},
      ...                      {"all_reduce": "local", "overhead_vs_none": 0.9},
      ...                      {"all_reduce": "onebit", "overhead_vs_none": 1.2}]}}
      >>> [(t["target"], t["met"]) for t in targets(r)]  # doctest: +NORMALIZE_WHITESPACE
      [('onebit (bucket 64) round trip >= 0.5 of copy', None),
       ('qsgd-4 (bucket 512) round trip >= 0.5 of copy', True),
       ('onebit step <= 1.10 x none', False)]
    """
    codecs = {c["compressor"]: c for c in r.get("compressors", [])}
    rows = []
    for name, share in ROUND_TRIP_TARGETS.items():
        value = codecs.get(name, {}).get("round_trip_of_copy")
        rows.append({"target": f"{name} round trip >= {share:g} of copy", "value": value,
                     "met": None if value is None else value >= share})
    for row in r.get("lm", {}).get("rows", []):
        if row["all_reduce"] in REFERENCE_STEPS:
            continue
        value = row["overhead_vs_none"]
        rows.append({"target": f"{row['all_reduce']} step <= {STEP_OVERHEAD_TARGET:.2f} x none",
                     "value": value, "met": value <= STEP_OVERHEAD_TARGET})
    return rows


def _unmeasured(row: dict[str, Any]) -> str | None:
    """Why a row has no figures (``error`` or ``skipped``), or None."""
    if "error" in row:
        return f"failed: {row['error']}"
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return None


def _codec_table(rows: list[dict[str, Any]]) -> list[str]:
    """The compressors' table."""
    lines = ["| compressor | bits/elem | encode ms | GB/s | of copy | decode ms | GB/s "
             "| of copy | EF round trip ms | GB/s | of copy | kernels | compiled bytes / 8n "
             "| compiled of copy |", "|---|" + "---:|" * 13]
    for c in rows:
        why = _unmeasured(c)
        if why:
            lines.append(f"| {c['compressor']} | {why} |" + " |" * 12)
            continue
        cells = [f"{c['bits_per_element']:.3f}"]
        for part in ("encode", "decode", "round_trip"):
            cells += [f"{c[part + '_ms']:.3f}", f"{c[part + '_gbs']:.1f}",
                      f"{c[part + '_of_copy']:.2f}"]
        traffic = c.get("round_trip_compiled_bytes")
        cells += (["-", "-", "-"] if traffic is None else
                  [str(c["round_trip_kernels"]), f"{traffic / c['round_trip_bytes']:.2f}",
                   f"{c['round_trip_compiled_of_copy']:.2f}"])
        lines.append(f"| {c['compressor']} | " + " | ".join(cells) + " |")
    return lines


def _lm_table(lm: dict[str, Any]) -> list[str]:
    """The language model's table, or why it was skipped."""
    if not lm.get("rows"):
        return [f"Skipped: {lm.get('skipped', 'not run yet when this was written')}."]
    g = lm["setting"]
    lines = [f"GPT {g['depth']} x {g['width']} ({g['heads']} heads, context {g['context']}, "
             f"{g['batch']} windows a step, {lm['rows'][0]['parameters']:,} parameters) "
             "on a one-device mesh:", "",
             "| all-reduce | step ms | step / none |", "|---|---:|---:|"]
    lines += [f"| {r['all_reduce']} | {r['step_ms']:.2f} | {r['overhead_vs_none']:.3f} |"
              for r in lm["rows"]]
    lines += [f"| {name} | {why} | |" for name, why in lm.get("not_measured", {}).items()]
    return lines


def _network_table(net: dict[str, Any]) -> list[str]:
    """The network rows, or why they were skipped."""
    if not net.get("rows"):
        return [f"Skipped: {net.get('skipped', 'not run yet when this was written')}."]
    lines = ["| method | devices | MiB / device | median ms | speedup vs psum | wire bytes |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['devices']} | {r['mib']:g} | {r['median_ms']:.3f} "
              f"| {r['speedup_vs_psum']:.2f} | {r['wire_bytes']:,} |" for r in net["rows"]]
    return lines


def _targets_section(r: dict[str, Any]) -> list[str]:
    """The targets' table and the profile of each program that missed one."""
    lines = ["| target | measured | met |", "|---|---:|---|"]
    for t in targets(r):
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        met = {None: "not measured", True: "yes", False: "**no**"}[t["met"]]
        lines.append(f"| {t['target']} | {value} | {met} |")
    for name, profile in r.get("profiles", {}).items():
        lines += ["", f"Profile of {name} (device time per operation, one call):", ""]
        if "error" in profile:
            lines.append(f"failed: {profile['error']}")
            continue
        lines.append(profile_table(profile["top"], len(profile["top"]), profile["total_ms"], 3))
    return lines


def markdown(r: dict[str, Any]) -> str:
    """The report of `qcollect.bench.device.run`'s result, complete or not."""
    s = r["setting"]
    head = [f"# Device benchmark: {r['platform']} ({r['device']}, {r['devices']} device(s), "
            f"jax {r['jax']})", "",
            f"Medians of {s['repeats']} interleaved repetitions of up to {s['calls']} "
            f"back-to-back calls; {r['seconds']:.0f} s in all."]
    if not r.get("complete"):
        head += ["", "**Incomplete**: written after the parts below; the rest had not run "
                 "yet (a run stopped from outside ends here)."]
    if "bandwidth_gbs" not in r:
        return "\n".join(head) + "\n"
    bw = r["bandwidth_gbs"]
    head += ["", f"Memory bandwidth over {r['stream_values']:,} float32 values (STREAM kernels, "
             f"{r['bandwidth_bytes']}): copy **{bw['copy']:.1f} GB/s**, read {bw['read']:.1f} "
             f"GB/s, triad {bw['triad']:.1f} GB/s.", "",
             f"## Codecs on a {r['shape'][0]} x {r['shape'][1]} float32 matrix", "",
             "GB/s: the bytes each call must move over its median time: encode reads the "
             "float32 input and writes the payload, decode the reverse, the error-feedback "
             "round trip `x - round_trip(x)` reads the input and writes the residual (8n "
             "bytes for n values). `of copy`: that rate over the copy bandwidth. The last "
             "three columns are the compiled round trip's: its memory-touching kernels, the "
             "bytes they read and write (`qc.memory_bytes`) over 8n, and that traffic's rate "
             "over the copy bandwidth (near 1: the kernels stream at copy speed and any gap "
             "is extra traffic; low: the kernels themselves are slow).", ""]
    body = head + _codec_table(r.get("compressors", []))
    body += ["", "## Language-model step", ""] + _lm_table(r.get("lm", {}))
    body += ["", "## All-reduce across devices", ""] + _network_table(r.get("network", {}))
    body += ["", "## Targets", "", "Set for a GPU, where the codecs are bound by memory "
             "bandwidth; on another platform they are for reference.", ""]
    body += _targets_section(r)
    return "\n".join(body) + "\n"
