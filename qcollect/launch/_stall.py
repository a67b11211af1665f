"""Stall detection: processes that wait in a collective for one that does not arrive.

Two detectors end a stalled job after ``--stall-timeout`` seconds, whichever
fires first:

1. The runtime's own: `qcollect.launch.initialize` sets XLA's CPU collective
   timeout (``--xla_cpu_collective_timeout_seconds``) to the stall timeout, so a
   Gloo collective whose peer does not arrive fails in every waiting process.
   JAX 0.10 has nothing else for a peer that is alive but stuck:
   ``jax.distributed``'s heartbeats only notice processes that died. The worker
   reports ``timeout`` and stays alive (so that the coordination service, in
   process 0, does not take the others down with it); the launcher waits
   `GRACE_SECONDS` for the other waiting processes to time out too.
2. The workers' stack samples (the worker wrapper, ``_worker.py``): a process blocked
   in one JAX call for the timeout while it stayed idle. This also covers
   waits outside Gloo collectives, and a timeout set higher in ``XLA_FLAGS``.

Either way the launcher names the processes that did not arrive: those whose
last report was neither a timeout nor an idle wait in JAX (outside JAX, busy
computing in JAX, or not started). When there is none, every process waited:
a deadlock, or a peer lost without exiting.

A process that finished its script (it reports ``done``) while the others
still wait for it is named the same way, as one that stopped arriving, and
`finished_early` names it sooner when needed: such a process waits in JAX's
exit-time shutdown barrier, which aborts every process `JAX_SHUTDOWN_SECONDS`
after it got there (JAX 0.10 passes ``shutdown_timeout_seconds`` to the
coordination service only; the client's own deadline for its shutdown call
stays 300 s).

A third deadline is Gloo's own and cannot be changed: the first collective
over a set of devices connects its processes, and a process whose peer is
more than 30 seconds late to it gives up, whatever the stall timeout
(``setup_timeout`` in ``_worker.py``). The worker reports it as a
timeout naming the late process, and `setup_stall` says so.

Reading the stack misses one kind of wait: a jitted call small enough for XLA
to run inline blocks inside the C++ dispatch with no JAX frame on the Python
stack, so it reads as the script's own code. Such a process still times out
under detector 1 and is not named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO, Literal, get_args

GRACE_SECONDS = 2.0
# Gloo's context timeout: how long the first collective over a set of devices
# waits for every process of it (fixed inside XLA's Gloo collectives).
GLOO_SETUP_SECONDS = 30
# How long a process that finished waits in JAX's exit-time shutdown barrier
# before JAX aborts the job, and how much sooner `finished_early` speaks.
JAX_SHUTDOWN_SECONDS = 300
EARLY_FINISH_MARGIN = 30
#: Where a worker is, by its last report (`Report.state`).
State = Literal["starting", "user", "jax", "timeout", "failed", "done", "port"]
STATES: tuple[State, ...] = get_args(State)
# States after which a worker sends nothing more (a late sample cannot replace them).
FINAL_STATES: tuple[State, ...] = ("timeout", "failed", "done", "port")


@dataclasses.dataclass(frozen=True)
class Report:
    """A worker's last report, stamped with the launcher's clock when it arrived.

    Attributes:
      state: ``"starting"`` (none yet), ``"user"`` (outside JAX), ``"jax"``
        (inside JAX), ``"timeout"`` (a collective failed on the timeout),
        ``"failed"`` (the script failed), ``"done"`` (the script returned)
        or ``"port"`` (process 0 found the coordinator's port taken).
      seconds: how long the worker had been in ``state`` when it reported.
      wait: how long it had been blocked, idle, in one JAX call, or None.
      at: ``time.monotonic()`` of the launcher when the report arrived.
      t: the worker's ``time.monotonic()`` when the script ended (final
        states), the same clock for every process of the machine.
      status: the exit status a ``"failed"`` worker is about to exit with.
      joined: whether the script joined the job (``joined`` in ``_worker.py``).
      peer_lost: the failure only says that a peer went away.
      late: for a timeout in Gloo's set-up, the processes that did not come
        (None for other timeouts).
    """

    state: State
    seconds: float
    wait: float | None
    at: float
    t: float | None = None
    status: int | None = None
    joined: bool | None = None
    peer_lost: bool = False
    late: tuple[int, ...] | None = None

    def state_age(self, now: float) -> float:
        """How long the worker had been in ``state`` at ``now`` (launcher's clock)."""
        return self.seconds + (now - self.at)

    def wait_age(self, now: float) -> float | None:
        """How long the worker had waited in one JAX call at ``now``, or None."""
        return None if self.wait is None else self.wait + (now - self.at)


def parse(line: bytes, at: float) -> Report | None:
    """The `Report` in one JSON line of a worker, or None if it is not one
    (not JSON, or a state that is not one of `STATES`)."""
    try:
        record = json.loads(line)
        state = next((s for s in STATES if s == str(record["state"])), None)
        if state is None:
            return None
        seconds = float(record.get("for") or 0.0)
        wait, t, status = record.get("wait"), record.get("t"), record.get("status")
        joined, late = record.get("joined"), record.get("late")
        return Report(state, seconds, None if wait is None else float(wait), at,
                      t=None if t is None else float(t),
                      status=None if status is None else int(status),
                      joined=None if joined is None else bool(joined),
                      peer_lost=bool(record.get("peer_lost")),
                      late=None if late is None else tuple(int(r) for r in late))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class Board:
    """The latest report of every rank, fed by one reader thread per worker pipe."""

    def __init__(self, nproc: int, now: float) -> None:
        self._lock = threading.Lock()
        self._reports = {r: Report("starting", 0.0, None, now) for r in range(nproc)}
        self.threads: list[threading.Thread] = []

    def read(self, rank: int, pipe: BinaryIO, clock: Callable[[], float]) -> None:
        """Starts a daemon thread that reads ``pipe`` (binary) until it closes,
        each report stamped with ``clock()``."""

        def loop() -> None:
            with contextlib.suppress(ValueError, OSError):
                for line in iter(pipe.readline, b""):
                    report = parse(line, clock())
                    if report is not None:
                        with self._lock:
                            if self._reports[rank].state not in FINAL_STATES:   # the last word
                                self._reports[rank] = report
            with contextlib.suppress(OSError):
                pipe.close()

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self.threads.append(t)

    def snapshot(self) -> dict[int, Report]:
        """Every rank's latest report, as of now."""
        with self._lock:
            return dict(self._reports)


def ranks(rs: Iterable[int]) -> str:
    """``"rank 1"`` or ``"ranks 0, 2"``."""
    ordered = sorted(rs)
    return (f"rank {ordered[0]}" if len(ordered) == 1
            else "ranks " + ", ".join(map(str, ordered)))


def describe(report: Report, now: float) -> str:
    """Where a process that did not arrive was, from its last report."""
    age = report.state_age(now)
    if report.state == "user":
        return f"outside JAX for {age:.1f} s"
    if report.state == "jax":
        return f"busy in JAX for {age:.1f} s"
    if report.state == "starting":
        return f"no report in {age:.1f} s"
    if report.state == "done":
        return f"finished its script {now - report.at:.1f} s before"
    return report.state


def _waiting(report: Report) -> bool:
    """The process waited for a peer: it timed out, or is blocked idle in JAX."""
    return report.state == "timeout" or (report.state != "done" and report.wait is not None)


def _stopped(reports: dict[int, Report], live: Iterable[int], now: float) -> str | None:
    """``"rank 1 stopped arriving (outside JAX for 7.2 s)"`` for the live ranks
    that were not waiting, or None when all were."""
    named = sorted(r for r in live if not _waiting(reports[r]))
    if not named:
        return None
    where = [describe(reports[r], now) for r in named]
    if len(named) > 1:
        where = [f"{r}: {w}" for r, w in zip(named, where, strict=True)]
    return f"{ranks(named)} stopped arriving ({'; '.join(where)})"


def sampled_stall(reports: dict[int, Report], live: Sequence[int], timeout: float, now: float
                  ) -> str | None:
    """Detector 2: the message when a live rank waited ``timeout`` in one JAX call.

    None while no rank waited that long, or while the ranks that did not wait
    that long are all still waiting (they time out or catch up first).
    """
    ages = _waited(reports, live, timeout, now)
    waited = sorted(ages)
    if not waited:
        return None
    longest = max(ages.values())
    stopped = _stopped(reports, live, now)
    if stopped is not None:
        return f"{stopped}; {ranks(waited)} waited {longest:.1f} s in JAX"
    if len(waited) == len(live):
        return f"every process ({ranks(waited)}) waited in JAX: a deadlock or a lost peer"
    return None


def _waited(reports: dict[int, Report], among: Iterable[int], timeout: float, now: float
            ) -> dict[int, float]:
    """Rank -> its wait in one JAX call, for the ranks ``among`` that waited
    ``timeout`` or more."""
    ages = {r: reports[r].wait_age(now) for r in among}
    return {r: age for r, age in ages.items() if age is not None and age >= timeout}


def setup_stall(reports: dict[int, Report], running: Sequence[int], now: float) -> str | None:
    """The message when a process gave up on Gloo's set-up deadline (None if none did).

    Names the processes it waited for and where they were, then the ones that
    gave up; ``running`` are the ranks that had not finished.
    """
    gave_up = sorted(r for r in running if reports[r].late is not None)
    if not gave_up:
        return None
    late = sorted({p for r in gave_up for p in reports[r].late or ()} - set(gave_up))
    where = [f"{r}: {describe(reports[r], now)}" if len(late) > 1 else describe(reports[r], now)
             for r in late if r in reports]
    named = f"{ranks(late)} ({'; '.join(where)})" if late else "a process"
    return (f"{named} came more than {GLOO_SETUP_SECONDS} s after {ranks(gave_up)} to their "
            "first collective: Gloo connects the processes of a group of devices at its "
            f"first collective and gives up after a fixed {GLOO_SETUP_SECONDS} s, which "
            "--stall-timeout does not change")


def finished_early(reports: dict[int, Report], live: Sequence[int], timeout: float, now: float
                   ) -> str | None:
    """The message when a process finished its script while live ones waited
    in JAX for ``timeout``, or for `JAX_SHUTDOWN_SECONDS` less
    `EARLY_FINISH_MARGIN` if that is shorter (None otherwise): a process
    that ended too soon, named before JAX's exit-time barrier aborts it."""
    bound = min(timeout, JAX_SHUTDOWN_SECONDS - EARLY_FINISH_MARGIN)
    done = sorted(r for r, rep in reports.items() if rep.state == "done")
    ages = _waited(reports, [r for r in live if r not in done], bound, now)
    waited = sorted(ages)
    if not done or not waited:
        return None
    longest = max(ages.values())
    first = min(reports[r].at for r in done)
    return (f"{ranks(done)} finished {now - first:.1f} s before, while {ranks(waited)} "
            f"waited {longest:.1f} s in JAX for {'it' if len(done) == 1 else 'them'}: "
            "a process that finished early (fewer steps or collectives than the others)")


def timeout_stall(reports: dict[int, Report], running: Sequence[int], now: float) -> str:
    """Detector 1: the message once the grace after the first timeout report is
    over; ``running`` are the ranks that had not finished when it came."""
    timed_out = sorted(r for r in running if reports[r].state == "timeout")
    waited = f"{ranks(timed_out)} timed out waiting in a collective"
    stopped = _stopped(reports, running, now)
    if stopped is not None:
        return f"{stopped}; {waited}"
    others = [r for r in running if r not in timed_out]
    if others:
        waited += f" and {ranks(others)} waited in JAX"
    return f"{waited}: a deadlock or a lost peer"
