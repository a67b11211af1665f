"""The type checker (mypy, configured in pyproject.toml) finds nothing in
`qcollect` and `transforms`: the public API's annotations hold."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mypy_is_clean(tmp_path):
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MYPY_FORCE_COLOR": "0"})
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_packages_say_they_are_typed():
    assert (ROOT / "qcollect" / "py.typed").exists()
    assert (ROOT / "transforms" / "py.typed").exists()
