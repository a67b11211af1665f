"""Phase marks: the names a phased program gives the branches it switches between.

A transformation that switches phases on a step count (PowerSGD's exact
and compressed steps, GradiVeQ's lead-in, sampling and compressed steps)
runs each phase's collectives inside a ``lax.cond`` (or ``lax.switch``)
branch. The compiled program holds every branch, so reading it says what
each branch sends but not which phase a branch is (`qcollect.wire_bytes`
counts the costliest or the cheapest). `phase` names it: the branch's code
runs under ``with qc.phase("compressed"):``, a `jax.named_scope` whose name
travels into the compiled HLO as each instruction's ``op_name`` metadata.
`qcollect.wire_bytes_by_phase` reads those marks back and measures each phase of a
compiled step, a user's own jitted step included: no second program, no
state set to a chosen step.

A mark may name several phases that run the same code (GradiVeQ's lead-in
and sampling steps). Marks nest; an instruction belongs to its innermost
mark, so a transformation inside another's branch names its own phases.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax

from qcollect.measure._hlo import Computations, control_callees, opcode

__all__ = ["in_phase", "phase", "phase_names", "program_phases"]

#: The scope prefix that marks a phase in ``op_name`` metadata.
MARK = "qcollect.phase="
_NAME = re.compile(r"[A-Za-z0-9_\-]+")
_FOUND = re.compile(r'op_name="([^"]*)"')
_LAST = re.compile(re.escape(MARK) + r"([A-Za-z0-9_\-,]+)")


def phase(*names: str) -> AbstractContextManager[Any]:
    """A context manager that marks the collectives traced inside it as
    belonging to the phases ``names``.

    Use it inside each branch of the ``lax.cond`` / ``lax.switch`` that picks
    a phase; `qcollect.wire_bytes_by_phase` then reports each phase by name.
    Outside a conditional a mark names the one phase the program is always
    in. It changes nothing in the computation: it is a `jax.named_scope`.

    Args:
      *names: one or more phase names, each of letters, digits, ``-`` and
        ``_`` (several when the branch serves several phases).

    Returns:
      A context manager; the code traced inside it carries the mark.

    Raises:
      ValueError: no name, or a name with another character.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> def step(x, count):
      ...     def warm_up(x):
      ...         with qc.phase("exact"):
      ...             return x + 1.0
      ...     def compressed(x):
      ...         with qc.phase("compressed"):
      ...             return x * 2.0
      ...     return jax.lax.cond(count < 10, warm_up, compressed, x)
      >>> float(jax.jit(step)(jnp.float32(3.0), 0))
      4.0
    """
    if not names:
        raise ValueError("phase needs at least one name")
    for name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError("phase names must be non-empty strings of letters, digits, '-' "
                             f"and '_', got {name!r}")
    return jax.named_scope(MARK + ",".join(names))


def phase_names(line: str) -> frozenset[str]:
    """The phases of one HLO instruction: those of the innermost mark in its
    ``op_name`` metadata (empty when it has none)."""
    found = _FOUND.search(line)
    if found is None:
        return frozenset()
    marks = _LAST.findall(found.group(1))
    return frozenset(marks[-1].split(",")) if marks else frozenset()


def _runs(rest: str, line: str) -> list[str]:
    """The computations an instruction (``rest``: from its opcode on) runs as
    control flow: loop body and condition, conditional branches, calls; not
    fused computations or reducers, which the compiler may share between
    branches."""
    names = control_callees(rest, line)
    if opcode(rest) == "async-start":
        names += re.findall(r"calls=%([\w.\-]+)", line)
    return names


def marked_phases(comp: str, comps: Computations,
                  memo: dict[str, frozenset[str]]) -> frozenset[str]:
    """The phases marked on ``comp``'s instructions and on those of the
    computations it runs (`_runs`), at any depth.

    Args:
      comp: a computation name of the parsed HLO.
      comps: ``{computation: [(name, shape, rest, line), ...]}``, as `parse`
        returns it.
      memo: a cache shared across calls on the same ``comps``.
    """
    if comp not in memo:
        memo[comp] = frozenset()  # a cycle adds nothing
        found: set[str] = set()
        for _name, _shape, rest, line in comps.get(comp, ()):
            found |= phase_names(line)
            for callee in _runs(rest, line):
                found |= marked_phases(callee, comps, memo)
        memo[comp] = frozenset(found)
    return memo[comp]


def program_phases(comps: Computations) -> list[str]:
    """Every phase marked anywhere in the parsed program, sorted."""
    return sorted({name for lines in comps.values() for *_, line in lines
                   for name in phase_names(line)})


def in_phase(name: str, memo: dict[str, frozenset[str]]
              ) -> Callable[[list[str], Computations], list[str]]:
    """The wire report's ``eligible``: of a conditional's branches, those
    marked with phase ``name``, or all when none is."""

    def eligible(branches: list[str], comps: Computations) -> list[str]:
        return [b for b in branches if name in marked_phases(b, comps, memo)] or branches

    return eligible
