"""A reader of XLA's optimised HLO text: computations, instructions, shapes,
and the one walk of the call graph that the readers of this package share.

`parse` splits the text of ``jax.jit(fn).lower(...).compile().as_text()``
into computations of ``(name, shape, rest, line)`` instructions and a table
of every value's shape; the helpers read an instruction's operands,
attributes and byte size. `walk` follows the program from its entry
computation through loops, conditionals and calls, and hands every
instruction a run executes, with how often it runs, to a reader: the wire
bytes (`qcollect.wire_bytes`) and the memory traffic
(`qcollect.memory_report`) are two readers of the same walk, so they agree
on every loop's trip count and fail alike where one is unknown.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import jax

__all__ = ["Branches", "Computations", "Eligible", "Instruction", "Program", "Site",
           "attribute", "branch_computations", "check_branches", "compiled_text",
           "control_callees", "opcode", "operands", "parse", "shape_bytes", "split_shape",
           "trip_count", "walk"]

#: Which branch of a conditional a reader counts: the costliest or the cheapest.
Branches = Literal["max", "min"]
#: One instruction of a computation: ``(name, shape, rest, line)``, ``rest`` the
#: text from its opcode on and ``line`` the whole HLO line.
Instruction = tuple[str, str, str, str]
#: The instructions of every computation of a program, by computation name.
Computations = dict[str, list[Instruction]]
#: ``eligible(branch_names, computations) -> names``: which branches of a
#: conditional may run (`walk`).
Eligible = Callable[[list[str], Computations], list[str]]
#: What a reader of `walk` collects: a wire-byte op, a kernel.
T = TypeVar("T")

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5,
    "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125, "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
#: The instructions whose computations `walk` runs as control flow.
_CONTROL = ("while", "conditional", "call")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (``"f32[4,8]"``, or a tuple of them), rounded down.

    Raises:
      ValueError: the shape has an element type whose size this reader does
        not know (it names the type), rather than a guessed size.
    """
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _ITEMSIZE:
            raise ValueError(f"unknown HLO element type {dtype!r} in the shape {shape[:200]!r}: "
                             "its size in bytes is not known, so no byte count is given; add "
                             "it to the element sizes (_ITEMSIZE) of qcollect/measure/_hlo.py")
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _ITEMSIZE[dtype]
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


class Program(NamedTuple):
    """A parsed HLO module (`parse`); unpacks as its four fields.

    Attributes:
      computations: the instructions of every computation, by name.
      shapes: the shape of every instruction and parameter, by name.
      entry: the entry computation's name (None in a text without one).
      default_group: the replica group size of a collective that lists none
        (the number of partitions or replicas).
    """

    computations: Computations
    shapes: dict[str, str]
    entry: str | None
    default_group: int


def parse(hlo: str) -> Program:
    """The `Program` of an HLO module's text: its computations, every value's
    shape, its entry computation and its default replica group size."""
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
    return Program(comps, shapes, entry, default_group)


def compiled_text(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The optimised HLO of ``jax.jit(fn)(*args, **kwargs)``."""
    # A jitted fn compiles through its own cache (no second compile after a call).
    lower = fn.lower if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn).lower
    return lower(*args, **kwargs).compile().as_text()


def check_branches(branches: object) -> None:
    """Raises ValueError unless ``branches`` is ``"max"`` or ``"min"``."""
    if branches not in ("max", "min"):
        raise ValueError(f"branches must be 'max' or 'min', got {branches!r}")


def opcode(rest: str) -> str:
    """The opcode of an instruction, from ``rest`` (the text from its opcode on)."""
    return rest.split("(", 1)[0].strip()


def trip_count(line: str) -> int | None:
    """A ``while`` instruction's trip count as XLA knows it (its
    ``known_trip_count``), or None when XLA does not know it."""
    found = _TRIPS.search(line)
    return int(found.group(1)) if found else None


def branch_computations(line: str) -> list[str]:
    """The branches of a ``conditional`` instruction, in order."""
    return re.findall(r"%([\w.\-]+)", attribute(
        r"branch_computations=\{([^}]*)\}|(true_computation=%[\w.\-]+, "
        r"false_computation=%[\w.\-]+)", line))


def control_callees(rest: str, line: str) -> list[str]:
    """The computations an instruction runs as control flow: a loop's body
    and condition, a conditional's branches, a call's computation (empty for
    any other instruction: fused computations and reducers are not control
    flow, and the compiler may share them between branches)."""
    op = opcode(rest)
    if op == "while":
        return [attribute(r"body=%([\w.\-]+)", line),
                attribute(r"condition=%([\w.\-]+)", line)]
    if op == "conditional":
        return branch_computations(line)
    if op == "call":
        return re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", line)
    return []


@dataclasses.dataclass(frozen=True)
class Site:
    """One instruction that a run of the program executes (`walk`).

    Attributes:
      computation: the computation holding it.
      name: its name.
      shape: its result shape.
      rest: its text from the opcode on.
      line: its whole HLO line.
      multiplicity: its executions per run: the product of the trip counts
        of the loops around it (one more for a loop's condition).
    """

    computation: str
    name: str
    shape: str
    rest: str
    line: str
    multiplicity: int

    @property
    def op(self) -> str:
        """Its opcode."""
        return opcode(self.rest)


def walk(program: Program, count: Callable[[Site], T | None], cost: Callable[[T], float], *,
         measures: str, branches: Branches = "max",
         enter: Callable[[Site], Sequence[str]] = lambda site: (),
         eligible: Eligible | None = None) -> list[T]:
    """What ``count`` gives for every instruction one run of ``program`` executes.

    From the entry computation down: a ``while`` loop's body runs once per
    iteration (XLA's ``known_trip_count``) and its condition once more; a
    ``call`` runs its computation once; of a ``conditional``'s branches (those
    ``eligible`` names, default all) the one whose items cost the most
    (``branches="max"``) or the least (``"min"``) counts, the first of
    equals. Every other instruction goes to ``count``, and the computations
    ``enter`` names for it (a fusion's, a reducer's) are walked as often as
    it runs. A loop that counts nothing, at any depth, needs no trip count.

    Args:
      program: a `parse`d module.
      count: the item one instruction adds (the `Site` says how often it
        runs), or None for nothing.
      cost: what an item weighs, per run, when a conditional's branch is chosen.
      measures: what the items measure (``"wire bytes"``), for the error.
      branches: ``"max"`` or ``"min"``, which branch of a conditional counts.
      enter: the computations to walk into from an instruction that is not
        control flow (default none).
      eligible: which branches of a conditional may run (default all).

    Returns:
      The items, in program order.

    Raises:
      ValueError: a loop that runs a counted instruction has no known trip
        count (the message names the loop and its computation).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> hlo = compiled_text(lambda v: jax.lax.fori_loop(0, 3, lambda i, a: jnp.sin(a), v),
      ...                     jnp.ones(8))
      >>> fusions = walk(parse(hlo), lambda s: s if s.op == "fusion" else None,
      ...                lambda s: 0, measures="fusions")
      >>> sorted({s.multiplicity for s in fusions})   # the body 3 times, the condition 4
      [3, 4]
    """
    check_branches(branches)
    items: list[T] = []
    if program.entry is not None:
        _Walk(program, count, cost, measures, branches == "max", enter,
              eligible).visit(program.entry, 1, (), items)
    return items


@dataclasses.dataclass
class _Walk(Generic[T]):
    """The state of one `walk`: its settings and which computations count anything."""

    program: Program
    count: Callable[[Site], T | None]
    cost: Callable[[T], float]
    measures: str
    most: bool
    enter: Callable[[Site], Sequence[str]]
    eligible: Eligible | None
    held: dict[str, bool] = dataclasses.field(default_factory=dict)

    def visit(self, comp: str, multiplicity: int, seen: tuple[str, ...], out: list[T]) -> None:
        """Adds to ``out`` the items of ``comp`` run ``multiplicity`` times."""
        if comp in seen or comp not in self.program.computations:
            return
        seen += (comp,)
        for instruction in self.program.computations[comp]:
            site = Site(comp, *instruction, multiplicity)
            op = site.op
            if op == "while":
                self.loop(site, seen, out)
            elif op == "conditional":
                out.extend(self.branch(site, seen))
            elif op == "call":
                for callee in control_callees(site.rest, site.line):
                    self.visit(callee, multiplicity, seen, out)
            else:
                item = self.count(site)
                if item is not None:
                    out.append(item)
                for callee in self.enter(site):
                    self.visit(callee, multiplicity, seen, out)

    def loop(self, site: Site, seen: tuple[str, ...], out: list[T]) -> None:
        """The items of a ``while`` loop: its body per trip, its condition once more."""
        body, condition = control_callees(site.rest, site.line)
        if not (self.holds(body) or self.holds(condition)):
            return  # counts nothing, however many times it runs
        trips = trip_count(site.line)
        if trips is None:
            raise ValueError(
                f"while loop %{site.name} in computation %{site.computation} (body %{body}) "
                f"has no known trip count, so its {self.measures} would depend on data; give "
                "it static bounds (a lax.fori_loop or lax.scan over Python ints, whose trip "
                "count XLA knows) or measure a program without the loop")
        self.visit(body, site.multiplicity * trips, seen, out)
        self.visit(condition, site.multiplicity * (trips + 1), seen, out)

    def branch(self, site: Site, seen: tuple[str, ...]) -> list[T]:
        """The items of the branch of a ``conditional`` that counts."""
        names = branch_computations(site.line)
        if self.eligible is not None:
            names = self.eligible(names, self.program.computations)
        best: list[T] = []
        best_cost: float | None = None
        for name in names:
            taken: list[T] = []
            self.visit(name, site.multiplicity, seen, taken)
            weight = sum(self.cost(item) for item in taken)
            if best_cost is None or (weight > best_cost if self.most else weight < best_cost):
                best, best_cost = taken, weight
        return best

    def holds(self, comp: str) -> bool:
        """True when ``comp``, or a computation the walk enters from it, at any
        depth, has an instruction that counts."""
        if comp not in self.held:
            self.held[comp] = False  # a cycle adds nothing
            for instruction in self.program.computations.get(comp, ()):
                site = Site(comp, *instruction, 1)
                if site.op in _CONTROL:
                    found = any(self.holds(c) for c in control_callees(site.rest, site.line))
                else:
                    found = (self.count(site) is not None
                             or any(self.holds(c) for c in self.enter(site)))
                if found:
                    self.held[comp] = True
                    break
        return self.held[comp]
