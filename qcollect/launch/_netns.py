"""Shaped star network of Linux network namespaces for local multi-process runs.

Layout: one hub namespace holds a bridge with the hub address ``.1``; every
worker namespace holds one end of a veth pair (``eth0``, address ``.10 + r``),
whose other end is a port of the bridge. Token-bucket filters (``tc qdisc
tbf``) shape both ends of every link, so each worker sends and receives at
most ``rate`` bits per second, as on a switch with full-duplex links; with a
delay, ``netem`` on the worker end delays every packet a worker sends.

Every namespace name starts with the same prefix, and the per-namespace hosts
files live in ``/etc/netns/<name>/`` (which ``ip netns exec`` bind-mounts over
``/etc/hosts``). `StarNetwork.close` removes all of them; deleting a namespace
also deletes the veth ends and the bridge inside it, so nothing is ever created
in the root namespace. A launcher killed with SIGKILL cannot close its
network: a `reaper` process it starts first removes the network when the
launcher is gone, and should that be killed too, `stale` finds what such
launchers left (the launcher's process id is in the names) and `remove`
deletes it, as every shaped launch does first.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Iterable

SUBNET = "10.213.0"
HUB_HOST = 1
FIRST_WORKER_HOST = 10
MAX_WORKERS = 200
NETNS_ETC = "/etc/netns"
NETNS_RUN = "/var/run/netns"
# Names the launcher gives: "qc<launcher pid>-hub", "qc<launcher pid>-<rank>".
LAUNCHER_NAME = re.compile(r"qc(\d+)-")


class NetworkSetupError(RuntimeError):
    """A namespace, link or qdisc could not be created."""


def missing_requirements() -> list[str]:
    """What a shaped network needs and this machine lacks (empty when all is there).

    Returns:
      Human-readable items: root privileges and the ``ip``, ``tc`` and
      ``unshare`` programs.
    """
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces need CAP_SYS_ADMIN)")
    for program in ("ip", "tc", "unshare"):
        if shutil.which(program) is None:
            missing.append(f"the `{program}` program")
    return missing


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetworkSetupError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")


def tbf_burst_bytes(rate_bits: int) -> int:
    """Bucket size for a tbf at ``rate_bits``: 4 ms of traffic, at least 32 KiB."""
    return max(32 * 1024, rate_bits // 8 // 250)


@dataclasses.dataclass
class StarNetwork:
    """Hub namespace with a bridge and ``size`` worker namespaces, each on a shaped link.

    Args:
      prefix: start of every namespace name (e.g. ``"qc1234"``): the hub is
        ``<prefix>-hub``, worker ``r`` is ``<prefix>-<r>``.
      size: number of worker namespaces (1 to 200).
      rate_bits: link rate in bits per second, or None for unshaped links.
      delay_us: one-way delay in microseconds added to what each worker sends
        (``netem``), or None.

    Use as a context manager, or call `open` and, always, `close`.
    """

    prefix: str
    size: int
    rate_bits: int | None = None
    delay_us: int | None = None
    namespaces: list[str] = dataclasses.field(default_factory=list)
    etc_dirs: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_WORKERS:
            raise ValueError(f"size must be in [1, {MAX_WORKERS}], got {self.size}")

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def hub_address(self) -> str:
        return f"{SUBNET}.{HUB_HOST}"

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}-{rank}"

    def hostname(self, rank: int) -> str:
        return f"{self.prefix}-{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{FIRST_WORKER_HOST + rank}"

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, device: str, delay: bool) -> None:
        tc = ("tc", "-n", namespace, "qdisc", "add", "dev", device)
        parent: tuple[str, ...] = ("root",)
        if delay and self.delay_us is not None:
            try:
                _run(*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_us}us")
            except NetworkSetupError as e:
                raise NetworkSetupError(f"{e} (--latency needs the kernel's netem qdisc, "
                                        "sch_netem)") from None
            parent = ("parent", "1:1", "handle", "10:")
        if self.rate_bits is not None:
            burst = tbf_burst_bytes(self.rate_bits)
            _run(*tc, *parent, "tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst),
                 "latency", "100ms")

    def _write_hosts(self, rank: int) -> None:
        directory = os.path.join(NETNS_ETC, self.namespace(rank))
        os.makedirs(directory, exist_ok=True)
        self.etc_dirs.append(directory)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{self.address(r)} {self.hostname(r)}" for r in range(self.size)]
        lines.append(f"{self.hub_address} {self.hub}")
        with open(os.path.join(directory, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def open(self) -> StarNetwork:
        """Creates the namespaces, bridge, links, qdiscs and hosts files.

        Raises:
          NetworkSetupError: a command failed (what was created is removed).
        """
        try:
            self._add_namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "addr", "add", f"{self.hub_address}/24", "dev", "br0")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for r in range(self.size):
                ns, port = self.namespace(r), f"{self.prefix}-p{r}"[-15:]
                self._add_namespace(ns)
                _run("ip", "-n", self.hub, "link", "add", port, "type", "veth",
                     "peer", "name", "eth0", "netns", ns)
                _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                self._shape(ns, "eth0", delay=True)
                self._shape(self.hub, port, delay=False)
                self._write_hosts(r)
        except BaseException:
            self.close()
            raise
        return self

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run in worker ``rank``'s namespace with its own hostname.

        ``ip netns exec`` enters the namespace and bind-mounts its hosts file;
        ``unshare --uts`` gives the process a private hostname, set to the name
        the hosts file maps to the worker's address (Gloo binds to the address
        the hostname resolves to). Each step ``exec``s the next, so the worker
        keeps the process id (and process group) the launcher started.
        """
        return ["ip", "netns", "exec", self.namespace(rank), "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(rank), *argv]

    def close(self) -> list[str]:
        """Deletes every namespace and hosts directory created; never raises.

        Returns:
          Error messages of deletions that failed (empty on success).
        """
        errors = []
        for ns in reversed(self.namespaces):
            proc = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True,
                                  check=False)
            if proc.returncode != 0 and os.path.exists(os.path.join(NETNS_RUN, ns)):
                errors.append(f"ip netns delete {ns}: {proc.stderr.strip()}")
        self.namespaces.clear()
        for directory in reversed(self.etc_dirs):
            shutil.rmtree(directory, ignore_errors=True)
            if os.path.exists(directory):
                errors.append(f"could not remove {directory}")
        self.etc_dirs.clear()
        return errors

    def __enter__(self) -> StarNetwork:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftovers(prefix: str) -> list[str]:
    """Namespaces and ``/etc/netns`` directories whose name starts with ``prefix``."""
    found = []
    for directory in (NETNS_RUN, NETNS_ETC):
        if os.path.isdir(directory):
            found += [os.path.join(directory, n) for n in sorted(os.listdir(directory))
                      if n.startswith(prefix)]
    return found


_REAPER_SCRIPT = ('cat >/dev/null; '
                  'for ns in "$1"/"$0"*; do [ -e "$ns" ] && ip netns delete "${ns##*/}"; done; '
                  'rm -rf "$2"/"$0"*')


def reaper(prefix: str) -> subprocess.Popen:
    """A process that removes every namespace and hosts directory whose name
    starts with ``prefix`` once its stdin is closed.

    The launcher holds the only write end of that pipe, so the removal runs
    when the launcher exits, however it ends (also by SIGKILL). The process is
    in a session of its own, out of reach of the terminal's Ctrl-C.
    """
    return subprocess.Popen(["sh", "-c", _REAPER_SCRIPT, prefix, NETNS_RUN, NETNS_ETC],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None when no
    such process runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X", "x"):
        return None
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def stale(prefix: str = "qc") -> dict[int, list[str]]:
    """What launchers that are no longer running left behind.

    A name ``qc<pid>-...`` belongs to the launcher with process id ``pid``; it
    is stale when no process ``pid`` runs, or when the one that does started
    after the namespace or directory was made (the id was reused).

    Returns:
      Launcher process id -> its namespaces (``/var/run/netns/...``) and hosts
      directories (``/etc/netns/...``).
    """
    owned: dict[int, list[str]] = {}
    for path in leftovers(prefix):
        m = LAUNCHER_NAME.match(os.path.basename(path))
        if m is not None:
            owned.setdefault(int(m.group(1)), []).append(path)
    boot = _boot_time()
    found: dict[int, list[str]] = {}
    for pid, paths in owned.items():
        started = process_start_time(pid)
        if started is not None:
            made = []
            for path in paths:
                try:
                    made.append(os.lstat(path).st_ctime)
                except OSError:
                    pass
            made = [t for t in made if t >= boot]
            # Running and older than what it owns (2 s for clock rounding): its own.
            if not made or started <= min(made) + 2.0:
                continue
        found[pid] = paths
    return found


def remove(paths: Iterable[str]) -> list[str]:
    """Deletes namespaces (``/var/run/netns/<name>``) and hosts directories; never raises.

    Returns:
      Error messages of deletions that failed (empty on success).
    """
    errors = []
    for path in paths:
        if os.path.dirname(path) == NETNS_RUN:
            name = os.path.basename(path)
            proc = subprocess.run(["ip", "netns", "delete", name], capture_output=True,
                                  text=True, check=False)
            if proc.returncode != 0 and os.path.exists(path):
                errors.append(f"ip netns delete {name}: {proc.stderr.strip()}")
        else:
            shutil.rmtree(path, ignore_errors=True)
            if os.path.exists(path):
                errors.append(f"could not remove {path}")
    return errors
