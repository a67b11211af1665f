"""Wire bytes measured from the compiled program, not computed from a config.

`wire_bytes(fn, *args)` compiles ``jax.jit(fn)`` for ``args``, reads the
optimised HLO, and adds up what each device sends in its collectives:

=====================  =============================================
op                     bytes sent per device
=====================  =============================================
collective-permute     operand bytes (devices that only send to
                       themselves send nothing)
all-gather             ``(N - 1) *`` operand bytes (ring all-gather)
all-reduce             ``2 (N - 1) / N *`` operand bytes (ring)
reduce-scatter         ``(N - 1) / N *`` operand bytes
all-to-all             ``(N - 1) / N *`` operand bytes
=====================  =============================================

N is the size of the op's replica group. The per-op figures are those of the
bandwidth-optimal algorithms (Gibiansky, "Bringing HPC Techniques to Deep
Learning"), so an XLA all-reduce and qcollect's ring all-reduce of the same
buffer count the same. Collectives inside a while loop count once per
iteration of its body (XLA's ``known_trip_count``), those of its condition
once more; a loop that runs no collective, at any depth, sends nothing and
needs no trip count, while one that does and has no known trip count (a
data-dependent ``lax.while_loop``) raises ValueError naming the loop. Of a
conditional's branches the largest counts, since one runs per call
(``branches="min"``: the smallest). Which branch is which phase of a
transformation that switches phases with ``lax.cond`` is read from its
marks by `qcollect.wire_bytes_by_phase`. docs/collectives.md#wire-bytes
shows the measured bytes of every algorithm.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from qcollect.measure._hlo import (
    Branches,
    Eligible,
    Site,
    check_branches,
    compiled_text,
    operands,
    parse,
    shape_bytes,
    walk,
)
from qcollect.measure._phases import in_phase, program_phases

__all__ = ["wire_bytes", "wire_bytes_by_axis", "wire_bytes_by_phase", "wire_report", "WireOp"]

_COLLECTIVES = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")


@dataclasses.dataclass(frozen=True)
class WireOp:
    """One collective of the compiled program and what it sends per device.

    Attributes:
      op: the collective's opcode (``"all-reduce"``, ``"collective-permute"``...).
      computation: the HLO computation holding it.
      operand_bytes: the bytes of its operands.
      group_size: ``N``, the devices of one replica group.
      bytes_per_call: what one device sends per execution (the table above).
      multiplicity: executions per call of the program (loop trip counts).
      devices: the device groups it runs over, as partition ids (its replica
        groups; for a collective-permute, its source-target pairs); None
        when the program does not list them (every device).
      arrays: the operands it carries (XLA combines all-reduces into one of
        several operands; across processes on the CPU backend each is an
        exchange of its own, see `qcollect.fused_psum`).
    """

    op: str
    computation: str
    operand_bytes: int
    group_size: int
    bytes_per_call: float
    multiplicity: int
    devices: tuple[tuple[int, ...], ...] | None = None
    arrays: int = 1


def _group_size(line: str, default: int) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    return default


def _device_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """Replica groups (or source-target pairs) of one collective, as ids.

    Both spellings of replica groups: explicit ``{{0,1},{2,3}}`` and iota
    ``[G,S]<=[d0,d1,...]`` with an optional transpose ``T(p0,p1,...)``.
    """
    if "source_target_pairs=" in line:
        pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[1]
                           .split("}}", 1)[0] + "}")
        return tuple((int(a), int(b)) for a, b in pairs)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        dims = [int(d) for d in m.group(3).split(",")]
        ids: np.ndarray = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        ids = ids.reshape(int(m.group(1)), int(m.group(2)))
        return tuple(tuple(int(i) for i in row) for row in ids)
    m = re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", line)
    if m:
        return tuple(tuple(int(i) for i in g.split(",") if i)
                     for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    return None


def _permute_factor(line: str) -> float:
    pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[-1])
    devices = {int(d) for pair in pairs for d in pair}
    moving = sum(1 for s, t in pairs if s != t)
    return moving / len(devices) if devices else 0.0


def wire_report(fn: Callable[..., Any], *args: Any, branches: Branches = "max",
                **kwargs: Any) -> list[WireOp]:
    """The collectives of ``jax.jit(fn)(*args)`` with their bytes per device.

    What `wire_bytes` adds up, one `WireOp` per collective: to see which
    collective of a program sends what, and how often.

    Args:
      fn: the function to compile, typically a `jax.shard_map` function.
      *args: its arguments (arrays or `jax.ShapeDtypeStruct`).
      branches: ``"max"`` or ``"min"``, which branch of each conditional
        is reported (see `wire_bytes`).
      **kwargs: its keyword arguments.

    Returns:
      The collectives in program order; their
      ``bytes_per_call * multiplicity`` sum to `wire_bytes`.

    Raises:
      ValueError: a loop that runs a collective has no known trip count.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
      >>> f = jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh,
      ...                   in_specs=P(), out_specs=P())
      >>> [(op.op, op.group_size, op.bytes_per_call) for op in qc.wire_report(f, jnp.zeros(1024))]
      [('all-reduce', 4, 6144.0)]
    """
    check_branches(branches)
    return report_from_hlo(compiled_text(fn, *args, **kwargs), branches)


def report_from_hlo(hlo: str, branches: Branches = "max",
                    eligible: Eligible | None = None) -> list[WireOp]:
    """The collectives of the optimised ``hlo`` (see `wire_report`), read by
    the walk that the memory traffic shares (`qcollect.measure._hlo.walk`).

    ``eligible(branch_names, comps) -> names``: which branches of a
    conditional may run (the phase marks of `qcollect.wire_bytes_by_phase`;
    default all); ``branches`` picks among them.
    """
    program = parse(hlo)

    def count(site: Site) -> WireOp | None:
        base = site.op.removesuffix("-start")
        if base not in _COLLECTIVES or site.op.endswith("-done"):
            return None
        names = operands(site.rest)
        operand = sum(shape_bytes(program.shapes.get(o, "")) for o in names)
        n = _group_size(site.line, program.default_group)
        factor = {
            "collective-permute": _permute_factor(site.line),
            "all-gather": n - 1,
            "all-reduce": 2 * (n - 1) / n,
            "reduce-scatter": (n - 1) / n,
            "all-to-all": (n - 1) / n,
        }[base]
        return WireOp(base, site.computation, operand, n, operand * factor, site.multiplicity,
                      _device_groups(site.line), len(names))

    def enter(site: Site) -> list[str]:
        """Fused and called computations, reducers: once per call of the instruction."""
        if site.op.endswith("-done"):
            return []
        return re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", site.line)

    return walk(program, count, lambda op: op.bytes_per_call * op.multiplicity,
                measures="wire bytes", branches=branches, enter=enter, eligible=eligible)


def wire_bytes(fn: Callable[..., Any], *args: Any, branches: Branches | None = None,
               **kwargs: Any) -> int:
    """Bytes each device sends in the collectives of the compiled ``fn(*args)``.

    Measured from the optimised HLO of ``jax.jit(fn)``, never computed from
    a compressor's settings, so what XLA really emits (fused, combined or
    looped collectives, the padding of packed words) is what counts. Per
    collective of a replica group of ``N`` devices: a collective-permute
    sends its operand, an all-gather ``N - 1`` times its operand, an
    all-reduce ``2 (N - 1) / N`` times (the bandwidth-optimal ring), a
    reduce-scatter or an all-to-all ``(N - 1) / N`` times; collectives in
    loops count once per iteration (docs/collectives.md#wire-bytes).

    Args:
      fn: the function to compile, typically a `jax.shard_map` or
        `jax.pmap` function, or an already jitted one.
      *args: its arguments (arrays or `jax.ShapeDtypeStruct`).
      branches: which branch of a conditional counts, ``"max"`` (the most
        a call can send) or ``"min"`` (the least). Left out, ``"max"``,
        with a warning when the program switches between marked phases
        that send different bytes (exact steps, then compressed ones):
        `qcollect.wire_bytes_by_phase` says what each phase sends.
      **kwargs: its keyword arguments.

    Returns:
      Bytes per device and call, rounded to an int.

    Warns:
      UserWarning: ``branches`` left out and the phases send different
        bytes; the message lists them.

    Raises:
      ValueError: a loop that runs a collective has no known trip count
        (its bytes would depend on data).

    References:
      Gibiansky, "Bringing HPC Techniques to Deep Learning" (2017): the
      ring all-reduce's ``2 (N - 1) / N`` bytes per device.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("d",))
      >>> f = jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh,
      ...                   in_specs=P("d"), out_specs=P())
      >>> qc.wire_bytes(f, jnp.zeros(jax.device_count() * 1024))  # doctest: +SKIP
      7168
    """
    if branches is not None:
        return total_bytes(wire_report(fn, *args, branches=branches, **kwargs))
    hlo = compiled_text(fn, *args, **kwargs)
    sent = total_bytes(report_from_hlo(hlo, "max"))
    phases = bytes_by_phase(hlo)
    if len(set(phases.values())) > 1:
        each = ", ".join(f"{name} {n:,}" for name, n in phases.items())
        warnings.warn(f"wire_bytes: the program switches between phases that send different "
                      f"bytes per call ({each}); counted the costliest, {sent:,}. "
                      "qcollect.wire_bytes_by_phase reports each phase; pass branches='max' "
                      "or 'min' to choose without this warning", stacklevel=2)
    return sent


def total_bytes(ops: Sequence[WireOp]) -> int:
    """What the ops of a `wire_report` send per device, rounded to a byte."""
    return int(round(sum(op.bytes_per_call * op.multiplicity for op in ops)))


def _find_mesh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for leaf in jax.tree.leaves((args, kwargs)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def _axes_of(groups: tuple[tuple[int, ...], ...], mesh: Any) -> tuple[str, ...]:
    """The mesh axes along which the devices of any one group differ."""
    shape = tuple(mesh.devices.shape)
    size = int(np.prod(shape))
    axes = set()
    for group in groups:
        if any(i >= size for i in group):
            raise ValueError(f"the program runs a collective over device {max(group)}, "
                             f"but the mesh has {size} devices")
        coords = np.array(np.unravel_index(np.asarray(group), shape)).T
        axes |= {k for k in range(len(shape)) if len(set(coords[:, k])) > 1}
    return tuple(name for k, name in enumerate(mesh.axis_names) if k in axes)


def wire_bytes_by_axis(fn: Callable[..., Any], *args: Any, mesh: Any = None,
                       branches: Branches = "max",
                       **kwargs: Any) -> dict[str | tuple[str, ...], int]:
    """`wire_bytes` split by the mesh axes each collective runs over.

    Each collective's device groups (replica groups, or a collective-permute's
    source-target pairs, read from the compiled HLO) are mapped to mesh
    coordinates; its bytes count under the axes along which the devices of a
    group differ: a name (``"node"``) for one axis, a tuple of names in mesh
    order for several (``("node", "local")``, a psum over both). The values
    add up to `wire_bytes`. On a multi-node mesh this is what crosses the
    slow network and what stays inside a node.

    Args:
      fn, args, kwargs, branches: as for `wire_bytes`.
      mesh: the `jax.sharding.Mesh` the program runs on; by default the mesh
        of the first argument with a ``NamedSharding``. Partition ``i`` is the
        device at flat position ``i`` of ``mesh.devices``.

    Returns:
      ``{axis name or tuple of names: bytes per device}``, without zero entries.

    Raises:
      ValueError: no mesh was given or found, or the program's devices are
        not the mesh's.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("node", "local"))
      >>> x = jax.device_put(jnp.zeros((8, 1024)), NamedSharding(mesh, P(("node", "local"))))
      >>> f = jax.shard_map(lambda v: jax.lax.psum(jax.lax.psum(v, "local"), "node"),
      ...                   mesh=mesh, in_specs=P(("node", "local")), out_specs=P())
      >>> qc.wire_bytes_by_axis(f, x)   # 2(L-1)/L and 2(M-1)/M of 4 KiB
      {'local': 6144, 'node': 4096}
    """
    mesh = mesh if mesh is not None else _find_mesh(args, kwargs)
    if mesh is None:
        raise ValueError("wire_bytes_by_axis needs the mesh: pass mesh=, or arguments "
                         "placed with a NamedSharding")
    totals: dict[str | tuple[str, ...], float] = {}
    everything = tuple(mesh.axis_names)
    for op in wire_report(fn, *args, branches=branches, **kwargs):
        sent = op.bytes_per_call * op.multiplicity
        if sent == 0:
            continue
        groups = op.devices
        if op.op == "collective-permute" and groups is not None:
            groups = tuple(pair for pair in groups if pair[0] != pair[1])
        axes = everything if groups is None else _axes_of(groups, mesh)
        key = axes[0] if len(axes) == 1 else axes
        totals[key] = totals.get(key, 0.0) + sent
    return {k: int(round(v)) for k, v in totals.items() if round(v)}


def bytes_along(split: dict[Any, int], axis: str) -> int:
    """Bytes of a `wire_bytes_by_axis` result sent by collectives that run over
    ``axis``, alone or with other axes (what crosses between nodes, for the
    ``"node"`` axis).

    Args:
      split: a `wire_bytes_by_axis` result. Keys may be names, tuples of
        names, or names joined by commas (the examples' JSON).
      axis: a mesh axis name.

    Returns:
      The sum of the entries whose key names ``axis``.

    Example:
      >>> import qcollect as qc
      >>> qc.bytes_along({"local": 6144, "node": 4096, ("node", "local"): 100}, "node")
      4196
    """

    def axes(key: str | tuple[str, ...]) -> tuple[str, ...]:
        if isinstance(key, tuple):
            return key
        return tuple(key.split(","))

    return sum(int(count) for key, count in split.items() if axis in axes(key))


def wire_bytes_by_phase(fn: Callable[..., Any], *args: Any, branches: Branches = "max",
                        **kwargs: Any) -> dict[str, int]:
    """`qcollect.wire_bytes` of one call in each phase that the compiled
    ``fn(*args)`` marks (`qcollect.phase`).

    A transformation that switches phases on its step count compiles every
    phase into one program, a ``lax.cond`` whose branches it marks;
    `qcollect.wire_bytes` counts the costliest (or the cheapest) branch
    whatever the step. For each phase, this counts the branches marked with
    it (or holding a branch marked with it, deeper inside) and every
    collective outside the marked conditionals, which runs in every phase.
    Which steps fall in which phase is the transformation's schedule
    (``transforms.CompressAfter(K).spans``, `transforms.gradiveq_phases`); what a
    run sends is the sum over its steps.

    Args:
      fn, args, kwargs: as for `qcollect.wire_bytes`; ``fn`` may be a user's
        own jitted training step that holds the transformation.
      branches: which branch counts at a conditional none of whose branches
        is marked with the phase: ``"max"`` (default) or ``"min"``.

    Returns:
      ``{phase name: bytes per device and call}``, sorted by name; ``{}``
      for a program that marks no phase.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax import lax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
      >>> def step(g, count):
      ...     def warm_up(g):
      ...         with qc.phase("exact"):
      ...             return lax.psum(g, "d")
      ...     def compressed(g):   # a quarter of the values, repeated
      ...         with qc.phase("compressed"):
      ...             return jnp.tile(lax.psum(g[:256], "d"), 4)
      ...     return lax.cond(count < 10, warm_up, compressed, g)
      >>> f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=P())
      >>> qc.wire_bytes_by_phase(f, jnp.zeros(1024), 0)   # 2 (4-1)/4 of 1 and 4 KiB
      {'compressed': 1536, 'exact': 6144}
    """
    check_branches(branches)
    return bytes_by_phase(compiled_text(fn, *args, **kwargs), branches)


def bytes_by_phase(hlo: str, branches: Branches = "max") -> dict[str, int]:
    """`wire_bytes_by_phase` of an optimised HLO text."""
    memo: dict[str, frozenset[str]] = {}
    return {name: total_bytes(report_from_hlo(hlo, branches, in_phase(name, memo)))
            for name in program_phases(parse(hlo)[0])}
