"""The package's shape: which folder may import which, and function sizes.

The layers of ``qcollect`` (docs/README.md, "The package at a glance"):

* the core (the modules directly under ``qcollect/``: the compressor
  contract, checks, the backend register, varying axes) imports only the
  standard library, jax, numpy and the core;
* ``coding/`` (bit-level formats) imports the core and itself;
* ``compressors/`` imports the core, ``coding/`` and itself;
* ``collectives/`` and ``measure/`` import anything below them;
* ``bench/`` and ``launch/`` are programs on top of the public package.

Nothing in ``transforms/`` imports a private ``qcollect`` module. Every
function in ``qcollect/``, ``transforms/`` and ``examples/common/`` is at most
80 lines long, docstring included.
"""

from __future__ import annotations

import ast
import pathlib

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
