"""examples/same_results.py: the side-by-side check of this tree against a revision."""

import pathlib
import shutil
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import example_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module():
    return example_script("same_results")


def test_digest_sees_one_bit_and_nothing_else():
    digest = _module()._digest
    a = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3, jnp.bfloat16)}
    # the same bits built another way: from NumPy, the zeros cast from float32
    same = {"w": jnp.asarray(np.array([[0.0, 1, 2], [3, 4, 5]], np.float32)),
            "b": jnp.asarray(np.zeros(3, np.float32)).astype(jnp.bfloat16)}
    flipped = {"w": a["w"].at[1, 2].set(jnp.nextafter(a["w"][1, 2], 10.0)), "b": a["b"]}
    negative_zero = {"w": a["w"], "b": -a["b"]}
    assert digest(a) == digest(same)
    assert digest(a) != digest(flipped)
    assert digest(a) != digest(negative_zero)   # bits, not values


def test_program_digest_ignores_source_locations_only():
    digest = _module().program_digest
    program = ('HloModule jit_step\n\nFileNames\n1 "{path}/train.py"\n\n'
               'ENTRY %main {{\n  %a = f32[4]{{0}} parameter(0)\n'
               '  %b = f32[4]{{0}} parameter(1)\n  %add.1 = f32[4]{{0}} add(%a, %b), '
               'metadata={{op_name="jit(step)/add" source_line={line}}}\n}}\n')
    here = digest(program.format(path="/a", line=10))
    assert here == digest(program.format(path="/tmp/b", line=99))
    assert here == digest(program.format(path="/a", line=10).replace("%add.1", "%sum.7"))
    assert here != digest(program.format(path="/a", line=10).replace("add(", "multiply("))
    assert here != digest(program.format(path="/a", line=10).replace("(%a, %b)", "(%b, %a)"))


@pytest.mark.parametrize("argv, message", [
    (["--models", "cnn"], "--models takes mlp and lm"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--timing-rounds", "-1"], "--timing-rounds must be >= 0"),
    (["--timing-steps", "6"], "--timing-steps must be > 6"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        _module().parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout")
def test_this_tree_against_its_own_commit(tmp_path):
    """The MLP at width 2048, one step of ``none``: the last commit and this
    tree give the same state unless this tree changed the code it runs; the
    worktree is removed afterwards."""
    before = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True,
                            text=True, check=True).stdout
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "examples/common",
                              "examples/mnist_mlp", "qcollect", "transforms"],
                             capture_output=True, text=True, check=True).stdout.strip()
    out = tmp_path / "table.md"
    status = _module().main(["--models", "mlp", "--compressors", "none", "--steps", "1",
                             "--timing-rounds", "0", "--out", str(out)])
    table = out.read_text()
    assert "| mlp | none |" in table
    if not changed:
        assert status == 0 and "| mlp | none | same | same |" in table
    after = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True,
                           text=True, check=True).stdout
    assert after == before
