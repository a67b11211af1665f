"""Records each test's measured time for the fast tier's ``heavy`` marker.

``tests/durations.json`` maps a test's node id to the seconds its setup,
call and teardown took in one run of the default suite (two xdist workers
on a 2-core machine). `tests/conftest.py` marks ``heavy`` every unit test
recorded above ``HEAVY_SECONDS``; a test not recorded (a new one) counts as
light until the file is remade. To remake it from a whole run::

    PYTEST_ADDOPTS="--durations=0 --durations-min=0.05" \\
        python -m pytest -q -n auto | tee run.log
    python tests/durations.py run.log
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

FILE = pathlib.Path(__file__).with_name("durations.json")
_LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S.*)$")


def parse(log: str) -> dict[str, float]:
    """Seconds per node id from pytest's ``--durations`` report in ``log``.

    Example:
      >>> parse("12.50s call     tests/test_a.py::test_b[x]\\n"
      ...       "0.20s setup    tests/test_a.py::test_b[x]")
      {'tests/test_a.py::test_b[x]': 12.7}
    """
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in log.splitlines():
        found = _LINE.match(line)
        if found:
            seconds[found.group(3).strip()] += float(found.group(1))
    return {node: round(s, 2) for node, s in sorted(seconds.items())}


def load() -> dict[str, float]:
    """The recorded seconds per node id (empty when nothing is recorded)."""
    return json.loads(FILE.read_text()) if FILE.exists() else {}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/durations.py RUN_LOG", file=sys.stderr)
        return 2
    seconds = parse(pathlib.Path(argv[0]).read_text())
    if not seconds:
        print(f"no --durations report in {argv[0]}", file=sys.stderr)
        return 1
    FILE.write_text(json.dumps(seconds, indent=0, sort_keys=True) + "\n")
    print(f"{len(seconds)} tests, {sum(seconds.values()):.0f} s in all -> {FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
