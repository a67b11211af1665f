"""Which worker failed first, and the line that names it.

The first failure the launcher notices is often not the cause: a peer of a
failed process fails in its next collective, and process 0 holds
``jax.distributed``'s service, whose end aborts the others. Each worker
reports how its script failed, stamped with its own ``time.monotonic()``
(one clock for every process of the machine), and the launcher notes when
each process died. `first_failure` names the earliest, preferring a failure
of its own over one that only says a peer went away (a process killed by a
signal cannot report, and its peers' errors say they lost it), and says
whether it had finished its script first while the others still waited.
"""

from __future__ import annotations

from qcollect.launch import _stall

#: ``(peer_lost, time, rank, status)`` of a process known to have failed; the
#: smallest is the one to name.
Failure = tuple[bool, float, int, int]
#: Rank -> ``(launcher's time.monotonic() when it died, its return code)``.
Deaths = dict[int, tuple[float, int]]


def exit_status(returncode: int) -> int:
    """A shell-style exit status: ``128 + n`` for death by signal ``n``.

    Example:
      >>> exit_status(-9), exit_status(3)
      (137, 3)
    """
    return 128 - returncode if returncode < 0 else returncode


def known_failures(reports: dict[int, _stall.Report], deaths: Deaths, count: int) -> list[Failure]:
    """Every one of ``count`` processes known to have failed: by its own report
    (its clock, and the status it dies with once its death is seen, else the
    one it reported, else 1), or by a non-zero death without one."""
    found = []
    for rank in range(count):
        report, death = reports[rank], deaths.get(rank)
        status = None if death is None else exit_status(death[1])
        if report.state == "failed" and report.t is not None:
            reported = report.status if status is None else status
            found.append((report.peer_lost, report.t, rank, 1 if reported is None else reported))
        elif death is not None and status:
            found.append((False, death[0], rank, status))
    return found


def first_failure(found: list[Failure], reports: dict[int, _stall.Report], now: float
                  ) -> tuple[int, str]:
    """``(status, message)`` of the process that failed first among ``found``:
    its status and how it ended (after it finished its script, or while
    others that had finished waited for it), and which failed after it."""
    _, _, rank, status = min(found)
    done = sorted(r for r, rep in reports.items() if rep.state == "done" and r != rank)
    how = f"exited with status {status}"
    barrier = (f"JAX's exit-time shutdown barrier (it gives up after "
               f"{_stall.JAX_SHUTDOWN_SECONDS} s)")
    if reports[rank].state == "done":
        how = (f"finished its script {now - reports[rank].at:.1f} s before, then {how} "
               f"in {barrier}, waiting for the others")
    elif done:
        age = now - min(reports[r].at for r in done)
        how += (f" while {_stall.ranks(done)}, which finished {age:.1f} s before, waited "
                f"for it in {barrier}")
    others = sorted(r for _, _, r, _ in found if r != rank)
    after = f" ({_stall.ranks(others)} failed after it)" if others else ""
    return status, f"rank {rank} {how}{after}; stopping the other processes"
