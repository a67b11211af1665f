"""examples/compile_transforms.py: one transform step compiled (and timed) on a small tree."""

import pathlib
import sys

import pytest

from tests.helpers import example_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _script():
    return example_script("compile_transforms")


@pytest.mark.slow  # compiles and runs GradiVeQ twice
def test_measures_a_step():
    """GradiVeQ: both phases compiled, a compressed step timed."""
    record = _script().measure("gradiveq", 2, runs=1, width=64)
    assert record["compile_s"] > 0 and record["lower_s"] > 0
    assert record["hlo_bytes"] > record["stablehlo_bytes"] / 10 > 0
    assert record["step_ms"] > 0


@pytest.mark.parametrize("argv", [["--methods", "powersgd,nope"], ["--params", "x"],
                                  ["--runs", "-1"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        _script().main(argv)
    assert exit_info.value.code == 2
