"""Command line of ``python -m qcollect.launch`` and its RATE / DELAY formats."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_DELAY_UNITS = {"us": 1, "usec": 1, "ms": 10**3, "msec": 10**3, "s": 10**6, "sec": 10**6}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def _scaled(text: str, units: dict[str, int], name: str, examples: str) -> int:
    """``number unit`` times the unit's factor, rounded; ValueError naming ``name``."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", text.strip().lower())
    if m is None or m.group(2) not in units:
        raise ValueError(f"{name} must be a number with a unit in "
                         f"{'/'.join(units)} (e.g. {examples}), got {text!r}")
    return round(float(m.group(1)) * units[m.group(2)])


def parse_rate(text: str, name: str = "--bandwidth") -> int:
    """Parses a link rate in ``tc`` units into bits per second.

    Args:
      text: a positive number and a unit: ``bit``, ``kbit``, ``mbit``,
        ``gbit``, ``tbit`` (powers of 1000 bits per second) or ``bps``,
        ``kbps``, ``mbps``, ``gbps`` (bytes per second), e.g. ``"1gbit"``,
        ``"100mbit"``, ``"12.5mbps"``; case-insensitive.
      name: the argument named in the error message.

    Returns:
      The rate in bits per second (an int of at least 8).

    Raises:
      ValueError: ``text`` is not such a rate.

    Example:
      >>> parse_rate("100mbit")
      100000000
    """
    bits = _scaled(text, _RATE_UNITS, name, "1gbit, 100mbit")
    if bits < 8:
        raise ValueError(f"{name} must be at least 8bit (one byte per second), got {text!r}")
    return bits


def parse_delay(text: str, name: str = "--latency") -> int:
    """Parses a delay in ``tc`` units into whole microseconds.

    Args:
      text: a non-negative number and a unit ``us``, ``ms`` or ``s`` (also
        ``usec``, ``msec``, ``sec``), e.g. ``"1ms"``, ``"250us"``;
        case-insensitive.
      name: the argument named in the error message.

    Returns:
      The delay in microseconds.

    Raises:
      ValueError: ``text`` is not such a delay, or is over 60 s.

    Example:
      >>> parse_delay("1.5ms")
      1500
    """
    micros = _scaled(text, _DELAY_UNITS, name, "1ms, 250us")
    if micros > 60 * 10**6:
        raise ValueError(f"{name} must be at most 60s, got {text!r}")
    return micros


def _positive(name: str, most: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type`` for a positive int of at most ``most`` (``why`` says why)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{name} must be at most {most}{why}, got {value}")
        return value

    return parse


def _typed(fn: Callable[[str, str], int], name: str) -> Callable[[str], int]:
    """An argparse ``type`` of a parser ``fn(text, name)`` that raises ValueError."""

    def parse(text: str) -> int:
        try:
            return fn(text, name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


NPROC_PER_CPU = 4
# XLA numbers process p's CPU devices p * 2048 + i: a process with more would
# give two devices the same id (jaxlib 0.10 fails creating the CPU client,
# "RET_CHECK failure ... device_id_map_"). At 2048 a process needs about
# 0.4 GB and starts in about a second.
MAX_DEVICES_PER_PROCESS = 2048


def nproc_limit() -> int:
    """The largest ``--nproc`` accepted without ``--force``: 4 x ``os.cpu_count()``."""
    return NPROC_PER_CPU * (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (errors exit with status 2)."""
    p = argparse.ArgumentParser(
        prog="python -m qcollect.launch",
        description="Runs NPROC local processes of a JAX script joined by jax.distributed "
                    "(Gloo CPU collectives), optionally over a shaped network of Linux "
                    "network namespaces. The script calls qcollect.launch.initialize() "
                    "before any other JAX use.")
    p.add_argument("--nproc", type=_positive("--nproc"), required=True,
                   help="number of processes")
    p.add_argument("--devices-per-process", default=1, metavar="K",
                   type=_positive("--devices-per-process", MAX_DEVICES_PER_PROCESS,
                                  " (XLA numbers each process's CPU devices in blocks of "
                                  f"{MAX_DEVICES_PER_PROCESS})"),
                   help="simulated CPU devices per process, 1 to "
                        f"{MAX_DEVICES_PER_PROCESS} (default 1)")
    p.add_argument("--bandwidth", type=_typed(parse_rate, "--bandwidth"), metavar="RATE",
                   help="shape every process's link to RATE each way (tc units: 1gbit, "
                        "100mbit, ...); runs each process in its own network namespace "
                        "(root, ip, tc and unshare required)")
    p.add_argument("--latency", type=_typed(parse_delay, "--latency"), metavar="DELAY",
                   help="one-way delay added to what each process sends (1ms, 250us, ...); "
                        "implies namespaces; needs the kernel's netem qdisc")
    p.add_argument("--kill-timeout", type=float, default=3.0, metavar="SECONDS",
                   help="after SIGTERM, seconds before SIGKILL (default 3)")
    p.add_argument("--stall-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="end the job (status 124, naming the ranks that stopped) when "
                        "processes have waited SECONDS in a collective for a process that "
                        "does not arrive, or all have waited in JAX that long; 0 turns it "
                        "off (default 600)")
    p.add_argument("--force", action="store_true",
                   help=f"allow --nproc above {NPROC_PER_CPU} x the CPU count")
    p.add_argument("script", help="Python script run as `python script [args]`")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and validates the launcher's command line.

    Raises:
      SystemExit: status 2 with a message naming the offending argument.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kill_timeout < 0:
        parser.error("--kill-timeout must be non-negative")
    if not (math.isfinite(args.stall_timeout)
            and (args.stall_timeout == 0 or args.stall_timeout >= 1)):
        parser.error(f"--stall-timeout must be 0 (off) or at least 1 second, "
                     f"got {args.stall_timeout:g}")
    if args.nproc > nproc_limit() and not args.force:
        parser.error(f"--nproc {args.nproc} is more than {NPROC_PER_CPU} processes per CPU "
                     f"({nproc_limit()} on {os.cpu_count()} CPUs); pass --force to run "
                     "that many anyway")
    return args
