"""The workload of the compile benchmarks, shared by ``python -m
qcollect.bench compile`` (the all-reduce alone) and
``examples/compile_transforms.py`` (the optax transforms' update step).

A transformer-shaped float32 pytree built of blocks of width ``d``: four
``d x d`` attention matrices, a ``d x 4d`` and a ``4d x d`` MLP matrix and
four ``d``-vectors (LayerNorm scales and biases), as many blocks as a
parameter count asks for; and the Markdown tables both programs print.

Example:
  >>> block_params(512), len(block_shapes(512)), blocks_for(38, 512)
  (3147776, 10, 12)
"""

from __future__ import annotations

from qcollect.bench._profile import profile_table

__all__ = ["block_params", "block_shapes", "blocks_for", "format_cell", "tables"]


def block_params(width: int) -> int:
    """Parameters of one block: ``4 d^2`` attention, ``8 d^2`` MLP, four ``d``-vectors."""
    return 12 * width * width + 4 * width


def block_shapes(width: int) -> dict[str, tuple[int, ...]]:
    """The leaves of one block: name -> shape."""
    d = width
    return {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
            "mlp_in": (d, 4 * d), "mlp_out": (4 * d, d),
            "attn_norm_scale": (d,), "attn_norm_bias": (d,),
            "mlp_norm_scale": (d,), "mlp_norm_bias": (d,)}


def blocks_for(target_millions: float, width: int) -> int:
    """Blocks whose parameters are nearest ``target_millions`` (at least one)."""
    return max(1, round(target_millions * 1e6 / block_params(width)))


def format_cell(record: dict, field: str = "compile_s") -> str:
    """One field of one measured record as table text (timeouts, skips and
    errors said as such; bytes in MB)."""
    if "timeout" in record:
        return f"> {record['timeout']:g} s"
    if "skipped" in record:
        return "skipped"
    if "error" in record:
        return "error"
    value = record.get(field)
    if value is None:  # no memory analysis from this backend
        return ""
    if field.endswith("_bytes"):
        return f"{value / 1e6:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.2f}"


def tables(rows: list[dict], methods: list[str], devices: int) -> str:
    """The markdown: compile seconds by size and method, then one table per method."""
    sizes = sorted({(r["parameters"], r["leaves"], r["blocks"]) for r in rows})
    by = {(r["blocks"], r["method"]): r for r in rows}
    out = [f"# Compile time and program size, {devices} simulated CPU devices",
           "", "Compile seconds (XLA, after lowering):", "",
           "| parameters | leaves | " + " | ".join(methods) + " |",
           "|---:|---:|" + "---:|" * len(methods)]
    for params, leaves, blocks in sizes:
        cells = [format_cell(by[blocks, m]) if (blocks, m) in by else "" for m in methods]
        out.append(f"| {params:,} | {leaves:,} | " + " | ".join(cells) + " |")
    stepped = any("step_ms" in r for r in rows)
    for m in methods:
        out += ["", f"## {m}", "",
                "| parameters | leaves | lower s | compile s | StableHLO MB "
                "| optimised HLO MB | kernels | distinct kernels | scratch MB |"
                + (" step ms |" if stepped else ""),
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if stepped else "")]
        for params, leaves, blocks in sizes:
            r = by.get((blocks, m))
            if r is None:
                continue
            fields = ("lower_s", "compile_s", "stablehlo_bytes", "hlo_bytes", "kernels",
                      "distinct_kernels", "temp_bytes") + (
                ("step_ms",) if stepped else ())
            cells = [format_cell(r, f) for f in fields]
            if "lower_s" not in r:
                cells = [cells[0]] + [""] * (len(fields) - 1)
            out.append(f"| {params:,} | {leaves:,} | " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("profile"):
            out += ["", f"### {r['method']}, {r['parameters']:,} parameters: device time",
                    "", profile_table(r["profile"], len(r["profile"]))]
    timeouts = sorted({r["timeout"] for r in rows if "timeout" in r})
    if timeouts:
        out += ["", f"\"> {timeouts[0]:g} s\": lower + compile ran past the timeout and was "
                "killed; the method's larger sizes are skipped."]
    errors = [r for r in rows if "error" in r]
    if errors:
        out += [""] + [f"- {r['method']}, {r['parameters']:,} parameters: {r['error']}"
                       for r in errors]
    return "\n".join(out)
