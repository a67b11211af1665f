"""A reader of XLA's optimised HLO text: computations, instructions, shapes.

`parse` splits the text of ``jax.jit(fn).lower(...).compile().as_text()``
into computations of ``(name, shape, rest, line)`` instructions and a table
of every value's shape; the helpers read an instruction's operands,
attributes and byte size. The wire-byte, memory-traffic and phase readers of
this package are built on it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

import jax

__all__ = ["Branches", "Computations", "Instruction", "attribute", "callees",
           "check_branches", "compiled_text", "operands", "parse", "shape_bytes", "split_shape"]

#: Which branch of a conditional a reader counts: the costliest or the cheapest.
Branches = Literal["max", "min"]
#: One instruction of a computation: ``(name, shape, rest, line)``, ``rest`` the
#: text from its opcode on and ``line`` the whole HLO line.
Instruction = tuple[str, str, str, str]
#: The instructions of every computation of a program, by computation name.
Computations = dict[str, list[Instruction]]

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (``"f32[4,8]"``, or a tuple of them), rounded down."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _ITEMSIZE.get(dtype, 4)
    return int(total)


def split_shape(rest: str) -> tuple[str, str]:
    """Splits ``"SHAPE op(...)..."`` into the shape and the remainder."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].strip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def operands(call: str) -> list[str]:
    """Names of the operands of ``op(%a, %b), attrs``."""
    start = call.index("(")
    depth = 0
    for i in range(start, len(call)):
        depth += call[i] == "("
        depth -= call[i] == ")"
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", call[start:i])
    return []


def attribute(pattern: str, line: str) -> str:
    """The first group of ``pattern`` that matched in the HLO ``line``."""
    m = re.search(pattern, line)
    if m is None:
        raise ValueError(f"cannot read {pattern!r} from the HLO line {line[:200]!r}")
    return next(g for g in m.groups() if g is not None)


def parse(hlo: str) -> tuple[Computations, dict[str, str], str | None, int]:
    """``(computations, shapes, entry, default_group)`` of an HLO module's text.

    ``shapes`` maps every instruction and parameter name to its shape,
    ``entry`` is the entry computation's name, and ``default_group`` the
    replica group size of a collective that lists none (the number of
    partitions or replicas).
    """
    header = hlo.split("\n", 1)[0]
    m = re.search(r"num_partitions=(\d+)", header)
    partitions = int(m.group(1)) if m else 1
    m = re.search(r"replica_count=(\d+)", header)
    default_group = max(partitions, int(m.group(1)) if m else 1)
    shapes: dict[str, str] = {}
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h and line.rstrip().endswith("{"):
            current = h.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            for pname, pshape in re.findall(r"([\w.\-]+):\s*(\([^)]*\)|[a-z0-9]+\[[0-9,]*\])",
                                            line[line.index("("):]):
                shapes[pname] = pshape
            continue
        d = _DEF.match(line)
        if d and current is not None:
            shape, rest = split_shape(line[d.end():])
            shapes[d.group(1)] = shape
            comps[current].append((d.group(1), shape, rest, line))
    return comps, shapes, entry, default_group


def compiled_text(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The optimised HLO of ``jax.jit(fn)(*args, **kwargs)``."""
    # A jitted fn compiles through its own cache (no second compile after a call).
    lower = fn.lower if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn).lower
    return lower(*args, **kwargs).compile().as_text()


def check_branches(branches: object) -> None:
    """Raises ValueError unless ``branches`` is ``"max"`` or ``"min"``."""
    if branches not in ("max", "min"):
        raise ValueError(f"branches must be 'max' or 'min', got {branches!r}")


def callees(line: str) -> list[str]:
    """The computations one instruction runs: loop body and condition, fused or
    called computations, reducers and conditional branches."""
    names = re.findall(r"(?:body|condition|calls|to_apply|true_computation|"
                       r"false_computation)=%([\w.\-]+)", line)
    for group in re.findall(r"(?:branch|called)_computations=\{([^}]*)\}", line):
        names += re.findall(r"%([\w.\-]+)", group)
    return names
