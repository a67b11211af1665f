"""Memory traffic measured from the compiled program: what each kernel must
read and write.

`memory_report(fn, *args)` compiles ``jax.jit(fn)`` for ``args`` and lists
every kernel of the optimised HLO that touches memory, with the bytes it
reads and writes per device; `memory_bytes` adds them up. Divided by the
memory bandwidth of the machine (a STREAM-style copy or triad,
``python -m qcollect.bench passes``) the total is the floor of the program's
time when memory bounds it, as the wire bytes over the link rate are when the
link does.

How each instruction counts (per device; collectives inside one process are
memory copies, so they count too):

=========================  ============================================
instruction                bytes read / written
=========================  ============================================
fusion                     each operand as the fused computation reads
                           it (only the slices when every use is a
                           ``slice`` or ``dynamic-slice``); its result,
                           or only the update when the root is an
                           in-place ``dynamic-update-slice``
dynamic-update-slice       the update, read and written (in place)
slice, dynamic-slice       the result, read and written
``*-start`` / ``*-done``   operands at the start, result at the done
parameter, constant,       nothing (no kernel)
tuple, bitcast, ...
anything else              operands / result
=========================  ============================================

Loops count once per iteration (XLA's ``known_trip_count``; a loop whose
trip count XLA does not know, a data-dependent ``lax.while_loop``, raises
ValueError naming it, as `qcollect.wire_bytes` does: both read the program
through one walk, `qcollect.measure._hlo.walk`); of a conditional's branches
the one with the least traffic counts (``branches="max"``: the most), so
that the total is a lower bound of what a call moves, as a floor should be.
Caches may still make a kernel faster than its bytes over the bandwidth:
the floor holds for data larger than the caches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qcollect.measure._hlo import (
    Branches,
    Instruction,
    Site,
    attribute,
    check_branches,
    compiled_text,
    opcode,
    operands,
    parse,
    shape_bytes,
    walk,
)

__all__ = ["Kernel", "memory_bytes", "memory_report"]

#: Instructions that move no data (views, bookkeeping).
_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "partition-id",
    "replica-id", "after-all", "opt-barrier", "add-dependency", "copy-start", "copy-done",
})
_SLICES = ("slice", "dynamic-slice")
_VIEWS = ("bitcast", "reshape")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One memory-touching instruction of the compiled program, per device.

    Attributes:
      name: the instruction's name in the HLO.
      op: its opcode (``fusion``, ``copy``, ``all-to-all``, ...).
      computation: the computation holding it.
      read: bytes it reads per call.
      written: bytes it writes per call.
      multiplicity: calls per run of the program (loop trip counts).
      shape: its result shape, as the HLO writes it.
    """

    name: str
    op: str
    computation: str
    read: int
    written: int
    multiplicity: int
    shape: str

    @property
    def traffic(self) -> int:
        """Bytes read and written per run of the program."""
        return (self.read + self.written) * self.multiplicity


def _fused_io(fused: list[Instruction], shapes: dict[str, str], operand_bytes: list[int],
              result_bytes: int) -> tuple[int, int]:
    """``(read, written)`` of a fusion whose computation is ``fused``."""
    params: dict[str, int] = {}
    users: dict[str, list[tuple[str, str]]] = {}
    root = fused[-1] if fused else None
    for name, _shape, rest, line in fused:
        op = opcode(rest)
        if op == "parameter":
            params[name] = int(attribute(r"parameter\((\d+)\)", rest))
        for o in operands(rest) if "(" in rest else ():
            users.setdefault(o, []).append((name, op))
        if line.lstrip().startswith("ROOT"):
            root = (name, _shape, rest, line)
    in_place: set[str] = set()
    written = result_bytes
    if root is not None:
        roots = [root]
        if opcode(root[2]) == "tuple":
            by_name = {f[0]: f for f in fused}
            roots = [by_name[o] for o in operands(root[2]) if o in by_name]
        updated = 0
        for r in roots:
            if opcode(r[2]) == "dynamic-update-slice":
                target, update = operands(r[2])[:2]
                if target in params:
                    in_place.add(target)
                updated += shape_bytes(shapes.get(update, ""))
            else:
                updated += shape_bytes(r[1])
        written = updated
    def reads(name: str, full: int) -> int:
        """Bytes read of ``name``: its slices' when every use slices it
        (through views), else all of it."""
        uses = users.get(name, [])
        if not uses:
            return full
        total = 0
        for user, op in uses:
            if op in _SLICES:
                total += shape_bytes(shapes.get(user, ""))
            elif op in _VIEWS:
                total += reads(user, full)
            else:
                return full
        return min(total, full)

    read = 0
    for pname, index in params.items():
        if pname not in in_place and index < len(operand_bytes):
            read += reads(pname, operand_bytes[index])
    return read, written


def report_from_hlo(hlo: str, branches: Branches = "min") -> list[Kernel]:
    """The memory-touching kernels of the optimised ``hlo`` (see `memory_report`),
    read by the walk that the wire bytes share (`qcollect.measure._hlo.walk`)."""
    program = parse(hlo)

    def count(site: Site) -> Kernel | None:
        op = site.op
        if op in _FREE:
            return None
        sizes = [shape_bytes(program.shapes.get(o, "")) for o in operands(site.rest)]
        result = shape_bytes(site.shape)
        if op == "fusion":
            fused = program.computations.get(attribute(r"calls=%([\w.\-]+)", site.line), [])
            read, written = _fused_io(fused, program.shapes, sizes, result)
        elif op == "dynamic-update-slice":
            read = written = sizes[1]
        elif op in _SLICES:
            read = written = result
        elif op.endswith("-start"):
            read, written = sum(sizes), 0
        elif op.endswith("-done"):
            read, written = 0, result
        else:
            read, written = sum(sizes), result
        if not (read or written):
            return None
        return Kernel(site.name, op, site.computation, read, written, site.multiplicity,
                      site.shape)

    return walk(program, count, lambda kernel: kernel.traffic, measures="memory traffic",
                branches=branches)


def memory_report(fn: Callable[..., Any], *args: Any, branches: Branches = "min",
                  **kwargs: Any) -> list[Kernel]:
    """The memory-touching kernels of ``jax.jit(fn)(*args)``, per device.

    Read from the optimised HLO, as XLA fused the program: what each kernel
    must read and write, so that a measured time can be set against the
    floor that memory bandwidth puts under it (a codec's efficiency in
    docs/compressors.md#quantizer-benchmark).

    Args:
      fn: the function to compile, or an already jitted one.
      *args: its arguments (arrays or `jax.ShapeDtypeStruct`).
      branches: which branch of each conditional counts, the one that moves
        the least (``"min"``, default: a floor) or the most (``"max"``).
      **kwargs: its keyword arguments.

    Returns:
      One `Kernel` per memory-touching instruction, in program order.

    Raises:
      ValueError: ``branches`` is neither ``"min"`` nor ``"max"``; or a loop
        that touches memory has no known trip count (a data-dependent
        ``lax.while_loop``: the message names it).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> x = jnp.ones(1024)
      >>> [(k.op, k.read, k.written) for k in qc.memory_report(lambda v: 2 * v + 1, x)]
      [('fusion', 4096, 4096)]
    """
    check_branches(branches)
    return report_from_hlo(compiled_text(fn, *args, **kwargs), branches)


def memory_bytes(fn: Callable[..., Any], *args: Any, branches: Branches = "min",
                 **kwargs: Any) -> int:
    """Bytes each device's kernels read and write in one run of
    ``jax.jit(fn)(*args)`` (`memory_report`'s total).

    Over the machine's memory bandwidth it is the time a memory-bound
    program cannot beat, as the wire bytes over the link rate are for the
    network.

    Args:
      fn: the function to compile, or an already jitted one.
      *args: its arguments (arrays or `jax.ShapeDtypeStruct`).
      branches: ``"min"`` (default, a floor) or ``"max"``, as for
        `memory_report`.
      **kwargs: its keyword arguments.

    Returns:
      The sum of every kernel's ``(read + written) * multiplicity``.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.memory_bytes(lambda v: 2 * v + 1, jnp.ones(1024))   # read and write 4 KiB
      8192
    """
    return sum(k.traffic for k in memory_report(fn, *args, branches=branches, **kwargs))
