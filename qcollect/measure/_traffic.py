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

Loops count once per iteration (XLA's ``known_trip_count``, 1 when it is
unknown); of a conditional's branches the one with the least traffic counts
(``branches="max"``: the most), so that the total is a lower bound of what a
call moves, as a floor should be. Caches may still make a kernel faster than
its bytes over the bandwidth: the floor holds for data larger than the
caches.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax

from qcollect.measure._hlo import Branches, Instruction, attribute, operands, parse, shape_bytes

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


def _opcode(rest: str) -> str:
    return rest.split("(", 1)[0].strip()


def _fused_io(fused: list[Instruction], shapes: dict[str, str], operand_bytes: list[int],
              result_bytes: int) -> tuple[int, int]:
    """``(read, written)`` of a fusion whose computation is ``fused``."""
    params: dict[str, int] = {}
    users: dict[str, list[tuple[str, str]]] = {}
    root = fused[-1] if fused else None
    for name, _shape, rest, line in fused:
        op = _opcode(rest)
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
        if _opcode(root[2]) == "tuple":
            by_name = {f[0]: f for f in fused}
            roots = [by_name[o] for o in operands(root[2]) if o in by_name]
        updated = 0
        for r in roots:
            if _opcode(r[2]) == "dynamic-update-slice":
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
    """The memory-touching kernels of the optimised ``hlo`` (see `memory_report`)."""
    comps, shapes, entry, _ = parse(hlo)
    fewer = branches == "min"
    kernels: list[Kernel] = []

    def visit(comp: str, multiplicity: int, seen: tuple[str, ...]) -> None:
        if comp in seen or comp not in comps:
            return
        for name, shape, rest, line in comps[comp]:
            op = _opcode(rest)
            if op in _FREE:
                continue
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trips = int(trip.group(1)) if trip else 1
                visit(attribute(r"body=%([\w.\-]+)", line), multiplicity * trips,
                      seen + (comp,))
                visit(attribute(r"condition=%([\w.\-]+)", line), multiplicity * (trips + 1),
                      seen + (comp,))
                continue
            if op == "conditional":
                called = re.findall(r"%([\w.\-]+)", attribute(
                    r"branch_computations=\{([^}]*)\}|(true_computation=%[\w.\-]+, "
                    r"false_computation=%[\w.\-]+)", line))
                best: list[Kernel] | None = None
                for b in called:
                    before = len(kernels)
                    visit(b, multiplicity, seen + (comp,))
                    taken = kernels[before:]
                    del kernels[before:]
                    traffic = sum(k.traffic for k in taken)
                    if best is None or (traffic < sum(k.traffic for k in best)) == fewer:
                        best = taken
                kernels.extend(best or [])
                continue
            if op == "call":
                visit(attribute(r"to_apply=%([\w.\-]+)", line), multiplicity, seen + (comp,))
                continue
            sizes = [shape_bytes(shapes.get(o, "")) for o in operands(rest)]
            result = shape_bytes(shape)
            if op == "fusion":
                read, written = _fused_io(comps.get(attribute(r"calls=%([\w.\-]+)", line), []),
                                          shapes, sizes, result)
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
            if read or written:
                kernels.append(Kernel(name, op, comp, read, written, multiplicity, shape))

    if entry is not None:
        visit(entry, 1, ())
    return kernels


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
      ValueError: ``branches`` is neither ``"min"`` nor ``"max"``.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> x = jnp.ones(1024)
      >>> [(k.op, k.read, k.written) for k in qc.memory_report(lambda v: 2 * v + 1, x)]
      [('fusion', 4096, 4096)]
    """
    lower = fn.lower if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn).lower
    if branches not in ("min", "max"):
        raise ValueError(f"branches must be 'min' or 'max', got {branches!r}")
    return report_from_hlo(lower(*args, **kwargs).compile().as_text(), branches)


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
