"""The package's shape: which folder may import which, and function sizes.

The layers of ``qcollect`` (docs/README.md, "The package at a glance"):

* the core (the modules directly under ``qcollect/``: the compressor
  contract, checks, the backend register, varying axes) imports only the
  standard library, jax, numpy and the core;
* ``coding/`` (bit-level formats) imports the core and itself;
* ``compressors/`` imports the core, ``coding/`` and itself;
* ``collectives/`` and ``measure/`` import anything below them;
* ``bench/`` and ``launch/`` are programs on top of the public package.

The package's boundary: ``import qcollect`` has no side effects (no exit
handler, no launcher or benchmark imported: ``qcollect/__init__.py`` imports
neither); ``bench/`` imports no private module of another part of the
package (its own ``bench/_x`` modules are fine); nothing under
``qcollect/`` imports ``examples/`` or any of its modules, or mentions
``sys.path``, but the one line of the launcher's worker that runs a script as
``python script.py`` does (`SYS_PATH_ALLOWED`).

Nothing in ``transforms/`` imports a private ``qcollect`` module. Every
function in ``qcollect/``, ``transforms/`` and ``examples/common/`` is at most
80 lines long, docstring included.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 80

#: What each folder of ``qcollect`` may import from ``qcollect``.
ALLOWED = {
    "core": {"core"},
    "coding": {"core", "coding"},
    "compressors": {"core", "coding", "compressors"},
    "collectives": {"core", "coding", "compressors", "collectives"},
    "measure": {"core", "coding", "compressors", "collectives", "measure"},
}
#: Third-party packages the core may import (with the standard library).
THIRD_PARTY = {"jax", "jaxlib", "numpy", "qcollect"}


def layer_of(name: str) -> str:
    """The layer of a dotted name under ``qcollect``: a subpackage's name,
    ``"core"`` for a module directly under ``qcollect/``, or ``"top"`` for a
    name taken from the package's namespace (which imports every layer)."""
    parts = name.split(".")
    if len(parts) == 1:
        return "top"
    if (ROOT / "qcollect" / parts[1]).is_dir():
        return parts[1]
    if (ROOT / "qcollect" / f"{parts[1]}.py").is_file():
        return "core"
    return "top"


def imports_of(source: str) -> list[str]:
    """The absolute names ``source`` imports (``from a import b`` gives ``a.b``)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def layering_violations(source: str, module: str) -> list[str]:
    """The imports of ``module`` (a dotted name) that its layer does not allow."""
    layer = layer_of(module) if module != "qcollect" else "top"
    if layer not in ALLOWED:
        return []
    bad = []
    for name in imports_of(source):
        top = name.split(".")[0]
        if top == "qcollect":
            target = layer_of(name)
            if target not in ALLOWED[layer]:
                bad.append(f"{module} ({layer}) imports {name} ({target})")
        elif layer == "core" and top not in THIRD_PARTY and top not in _stdlib():
            bad.append(f"{module} (core) imports {name}")
    return bad


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names) | {"__future__"}


def _modules():
    for path in sorted((ROOT / "qcollect").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts[-1] = "_init"  # a subpackage's __init__ is in its own layer
        yield ".".join(parts), path


def test_every_layer_imports_only_what_it_may():
    bad = []
    for module, path in _modules():
        bad += layering_violations(path.read_text(), module)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module,source", [
    ("qcollect.compressors._onebit", "from qcollect.collectives._ring import permute\n"),
    ("qcollect.compressors._qsgd", "import qcollect.measure._wire\n"),
    ("qcollect.coding._packing", "from qcollect.compressors._groups import to_view\n"),
    ("qcollect._payload", "import optax\n"),
    ("qcollect._payload", "from qcollect.collectives import _layout\n"),
    ("qcollect.coding._sparse", "from qcollect import pack_bits\n"),
])
def test_the_layering_check_fails_on_an_upward_import(module, source):
    assert layering_violations(source, module)


def test_the_layering_check_accepts_downward_imports():
    assert not layering_violations(
        "from qcollect.compressors._groups import to_view\nfrom qcollect._payload import"
        " Payload\nimport jax\n", "qcollect.collectives._layout")
    assert not layering_violations("import functools\nimport numpy as np\n",
                                   "qcollect._payload")


#: Subpackages that ``qcollect/__init__.py`` must not import (programs on top of it).
PROGRAMS = ("qcollect.launch", "qcollect.bench")
#: Files under ``qcollect/`` that may mention ``sys.path``, and why.
SYS_PATH_ALLOWED = {
    "qcollect/launch/_worker.py": "the worker runs the user's script as `python script.py` "
                                  "would, the script's folder first on the import path, where "
                                  "the interpreter put the worker's own folder",
}


def top_level_violations(source: str) -> list[str]:
    """The imports of the package's ``__init__.py`` source that load a program
    (`PROGRAMS`): ``import qcollect`` must not start the launcher or a benchmark."""
    return [name for name in imports_of(source)
            if any(name == p or name.startswith(p + ".") for p in PROGRAMS)]


def test_the_package_imports_no_launcher_nor_benchmark():
    assert not top_level_violations((ROOT / "qcollect" / "__init__.py").read_text())


@pytest.mark.parametrize("source", [
    "from qcollect.launch import warn_unjoined_at_exit\n",
    "import qcollect.bench.device\n",
    "from qcollect import launch\n",
    "def f():\n    from qcollect.bench import training\n",
])
def test_the_top_level_check_fails_on_a_program_import(source):
    assert top_level_violations(source)


def test_the_top_level_check_accepts_the_layers():
    assert not top_level_violations("from qcollect._payload import Compressor\n"
                                    "from qcollect.collectives._ring import permute\n")


#: What ``import qcollect`` adds, printed by a fresh interpreter: exit handlers
#: (JAX and numpy, imported first, register their own) and loaded programs.
IMPORT_EFFECTS = """\
import atexit, sys
import jax, numpy
before = atexit._ncallbacks()
import qcollect
print(atexit._ncallbacks() - before,
      sorted(m for m in sys.modules if m.startswith(("qcollect.launch", "qcollect.bench"))))
"""


def test_importing_the_package_has_no_side_effects():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", IMPORT_EFFECTS], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.splitlines()[0] == "0 []", out.stdout + out.stderr


def bench_private_imports(source: str, module: str) -> list[str]:
    """The imports of ``module`` (under ``qcollect.bench``) of a private
    module or name (``_x``) of another part of the package."""
    bad = []
    for name in imports_of(source):
        parts = name.split(".")
        if parts[0] != "qcollect" or (len(parts) > 1 and parts[1] == "bench"):
            continue
        if any(p.startswith("_") for p in parts[1:]):
            bad.append(f"{module} imports {name}")
    return bad


def test_benchmarks_use_no_private_module_of_another_part():
    bad = []
    for module, path in _modules():
        if module.startswith("qcollect.bench."):
            bad += bench_private_imports(path.read_text(), module)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from qcollect.collectives._ring import permute\n",
    "from qcollect import _backend\n",
    "import qcollect.launch._runner\n",
    "from qcollect.measure import _hlo\n",
])
def test_the_bench_check_fails_on_a_private_import(source):
    assert bench_private_imports(source, "qcollect.bench.device")


def test_the_bench_check_accepts_its_own_private_modules():
    assert not bench_private_imports(
        "from qcollect.bench._network import buffers\nfrom qcollect.bench import _timing\n"
        "import qcollect as qc\nfrom qcollect.launch import parse_rate\nimport jax\n",
        "qcollect.bench.device")


def _example_modules() -> frozenset[str]:
    """``examples`` and the names its programs import their modules by
    (``examples/`` is first on their import path): its packages and files."""
    folder = ROOT / "examples"
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.parent.name for p in folder.glob("*/__init__.py")}
    return frozenset(names | {"examples"})


def example_violations(source: str, path: str,
                       examples: frozenset[str] = frozenset({"examples"})) -> list[str]:
    """Where the source of ``path`` (relative to the repository) imports a
    module of ``examples`` (top-level names) or mentions ``sys.path``
    (unless `SYS_PATH_ALLOWED`)."""
    bad = [f"{path} imports {name}" for name in imports_of(source)
           if name.split(".")[0] in examples]
    if path not in SYS_PATH_ALLOWED:
        bad += [f"{path}:{source.count(chr(10), 0, m.start()) + 1} mentions sys.path"
                for m in re.finditer(r"\bsys\.path\b", source)]
    return bad


def test_nothing_in_the_package_imports_the_examples_or_touches_sys_path():
    examples = _example_modules()
    assert {"common", "lm", "training_gate"} <= examples
    bad = []
    for _, path in _modules():
        bad += example_violations(path.read_text(), path.relative_to(ROOT).as_posix(), examples)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source", [
    "import training_gate\n",
    "from common.config import COMPRESSOR_NAMES\n",
    "from examples.lm import model\n",
    "import sys\nsys.path.insert(0, folder)\n",
    "def f():\n    '''Puts the folder on sys.path.'''\n",
])
def test_the_examples_check_fails_on_an_import_or_sys_path(source):
    assert example_violations(source, "qcollect/bench/device.py",
                              frozenset({"examples", "common", "training_gate"}))


def test_the_examples_check_accepts_finding_the_folder_by_path():
    ok = "import sys\nimport json\nfrom qcollect.bench.training import examples_dir\n"
    assert not example_violations(ok, "qcollect/bench/device.py",
                                  frozenset({"examples", "common"}))
    worker = "import sys\nsys.path[0] = folder\n"
    assert not example_violations(worker, "qcollect/launch/_worker.py")
    assert example_violations(worker, "qcollect/launch/_runner.py")


def test_transforms_use_only_the_public_qcollect():
    bad = []
    for path in sorted((ROOT / "transforms").glob("*.py")):
        for name in imports_of(path.read_text()):
            if name.startswith("qcollect.") and any(p.startswith("_") for p in name.split(".")):
                bad.append(f"{path.name} imports {name}")
    assert not bad, "\n".join(bad)


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """``(name, line, length)`` of every function over ``limit`` lines,
    decorators excluded and docstring included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def test_no_function_is_over_80_lines():
    found = []
    for folder in ("qcollect", "transforms", "examples/common"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, line, length in long_functions(path.read_text()):
                found.append(f"{path.relative_to(ROOT)}:{line} {name}: {length} lines")
    assert not found, "\n".join(found)


def test_the_length_check_counts_docstrings():
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    doc = '    """' + "\n" * 12 + '    """\n'
    assert not long_functions(f"def f():\n{body}\n")
    assert long_functions(f"def f():\n{doc}{body}\n") == [("f", 1, 84)]
