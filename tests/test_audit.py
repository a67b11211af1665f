"""Assertions that cannot fail, and tests that check nothing.

An AST audit over every ``tests/test_*.py``. It reports, as ``file:line``:

* ``same-sides``: a comparison whose two sides are the same expression
  (``assert x == x``, ``assert f(a) == f(a)``; also ``is``, ``<=``, ``>=``),
  names holding one expression computed twice with nothing in between
  included (``a, b = f(x), f(x)``; ``a = f(x)`` right before a check of
  ``f(x)`` against ``a``);
* ``same-args``: an ``assert*`` call (``np.testing.assert_allclose``,
  ``assertEqual``, ``chex.assert_trees_all_close``, also mapped over trees
  by ``jax.tree.map``) whose two compared arguments are the same expression;
* ``constant``: ``assert`` on a truthy constant or a non-empty literal
  (``assert True``, ``assert (x, "message")``, ``assert "text"``);
* ``no-check``: a test function with no ``assert``, no ``pytest.raises`` /
  ``pytest.warns`` and no call of a function whose name starts with
  ``assert``, ``check``, ``_check``, ``_assert`` or ``expect`` (helpers that
  check are named so).

Running the same program twice and comparing the results is a real check
when determinism (or value equality, or a cache) is the point of the
test; those tests are named in `ALLOWED` with the kind and the reason.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = sorted((ROOT / "tests").glob("test_*.py"))

#: ``"file::test"`` -> (the kind of offence allowed there, why it checks something).
ALLOWED: dict[str, tuple[str, str]] = {
    "test_compressor_values.py::test_traced_array_settings_compare_without_tracer_errors": (
        "same-sides", "two compressors built apart from one NumPy array: that separate "
        "builds compare equal (value semantics, next to the copy that does not) is the point"),
    "test_entropy.py::test_plan_is_exact_and_with_plan_is_cached": (
        "same-sides", "`is` between two calls of with_plan: that the second call returns the "
        "cached compressor is the point"),
    "test_ef21.py::test_strategies_are_values": (
        "same-sides", "equality and hash of strategies built apart: value semantics "
        "(DESIGN: equal settings, equal value, same hash) is the point"),
    "test_compressor_values.py::test_equal_settings_make_equal_compressors": (
        "same-sides", "two compressors built apart from the same settings: that they are "
        "distinct objects, equal and of one hash is the point (value semantics)"),
    "test_compressor_values.py::test_static_jit_argument_shares_the_compiled_program": (
        "same-args", "two calls of one compiled program with equal compressors: that the "
        "second reuses the first's program (one trace) and gives its bits is the point"),
    "test_adaptive.py::test_sampled_needs_key_and_depends_on_it": (
        "same-args", "the sampled threshold under one key twice (the same bits) and under "
        "another (different bits): that the result is a function of the key is the point"),
    "test_tx_allreduce.py::test_equal_compressors_fuse_whatever_the_object": (
        "same-sides", "a compressor built again equals and hashes like the shared one: the "
        "premise of fusing per-leaf choices that build new compressors"),
    "test_docs.py::test_python_blocks_run": (
        "no-check", "the check is the exec: a block that raises (its own asserts included) "
        "fails the test"),
}

#: Prefixes of the names of functions that check (a test calling one checks).
CHECKS = ("assert", "check", "_check", "_assert", "expect")
#: Comparisons that hold whenever both sides are the same value.
REFLEXIVE = (ast.Eq, ast.Is, ast.LtE, ast.GtE)
#: Comparisons of two arrays that return a bool (``assert np.allclose(a, b)``).
CLOSE = {"allclose", "array_equal", "array_equiv", "isclose", "equal", "tree_allclose"}
#: Keyword names of the compared values of ``assert*`` functions.
COMPARED = ("actual", "desired", "expected", "first", "second", "x", "y", "a", "b")
#: ``pytest`` context managers and calls that are checks themselves.
PYTEST_CHECKS = {"raises", "warns", "deprecated_call", "fail"}


def _same(a: ast.AST, b: ast.AST, names: dict[str, str] | None = None) -> bool:
    """Whether ``a`` and ``b`` are one expression once the names of
    ``names`` (`_twins`) are read as the expression they were assigned."""
    return _expanded(a, names or {}) == _expanded(b, names or {})


def _expanded(node: Any, names: dict[str, str]) -> str:
    """``ast.dump`` of ``node`` (without contexts), ``names`` substituted."""
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.AST):
        fields = ", ".join(f"{k}={_expanded(v, names)}" for k, v in ast.iter_fields(node)
                           if k != "ctx")
        return f"{type(node).__name__}({fields})"
    if isinstance(node, list):
        return "[" + ", ".join(_expanded(v, names) for v in node) + "]"
    return repr(node)


def _assigned(stmt: ast.AST) -> dict[str, ast.AST]:
    """``{name: expression}`` of ``name = expr`` or ``a, b = x, y``."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return {}
    target, value = stmt.targets[0], stmt.value
    if isinstance(target, ast.Name):
        return {target.id: value}
    if (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
            and len(target.elts) == len(value.elts)):
        return {t.id: v for t, v in zip(target.elts, value.elts, strict=True)
                if isinstance(t, ast.Name)}
    return {}


def _blocks(fn: ast.AST):
    """Every list of statements in ``fn`` (bodies, ``else`` and ``finally`` blocks)."""
    for node in ast.walk(fn):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _twins(fn: ast.AST, once: set[str]) -> dict[str, str]:
    """The names of ``fn`` that hold one expression computed twice with
    nothing in between (``a, b = f(x), f(x)``, or ``a = f(x)`` right after
    ``b = f(x)``), each mapped to that expression's dump."""
    twins: dict[str, str] = {}
    for block in _blocks(fn):
        for first, second in zip([ast.Pass(), *block], block):
            pairs = list(_assigned(first).items()) + list(_assigned(second).items())
            for i, (n, v) in enumerate(pairs):
                for m, w in pairs[i + 1:]:
                    if n != m and {n, m} <= once and _same(v, w):
                        twins[n] = twins[m] = _expanded(v, {})
    return twins


def _bound_once(fn: ast.AST) -> set[str]:
    """The names bound once in ``fn`` (an argument, or one assignment) and
    never changed in place (``x[i] = ...``, ``x.a = ...``, ``x.append(...)``)."""
    counts: dict[str, int] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            counts[node.id] = counts.get(node.id, 0) + 1
        elif isinstance(node, ast.arg):
            counts[node.arg] = counts.get(node.arg, 0) + 1
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            changed = node.func.value
        elif (isinstance(node, (ast.Subscript, ast.Attribute))
              and isinstance(node.ctx, (ast.Store, ast.Del))):
            changed = node.value
        else:
            changed = None
        if isinstance(changed, ast.Name):
            counts[changed.id] = 2
    return {n for n, c in counts.items() if c == 1}


def _name(func: ast.AST) -> str:
    """The called name: ``f`` of ``f(...)``, ``g`` of ``a.b.g(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_tree_map(func: ast.AST) -> bool:
    """``jax.tree.map``, ``jax.tree_util.tree_map``, ``tree_map``, ``map``."""
    return _name(func) in {"map", "tree_map"}


def _truthy_constant(test: ast.AST) -> bool:
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, (ast.Tuple, ast.List, ast.Set)):
        return bool(test.elts)
    if isinstance(test, ast.Dict):
        return bool(test.keys)
    return isinstance(test, ast.JoinedStr) and bool(test.values)


def _same_args(call: ast.Call, names: dict[str, str]) -> bool:
    """An ``assert*`` call (or a tree map of one) comparing an expression with itself."""
    args = [*call.args, *(k.value for k in call.keywords if k.arg in COMPARED)]
    if _name(call.func).lower().startswith("assert"):
        return len(args) >= 2 and _same(args[0], args[1], names)
    if _is_tree_map(call.func) and len(args) >= 3 and _is_assert_function(args[0]):
        return _same(args[1], args[2], names)
    return False


def _is_assert_function(node: ast.AST) -> bool:
    """An ``assert*`` function, or a lambda that calls one."""
    if isinstance(node, ast.Lambda):
        node = node.body.func if isinstance(node.body, ast.Call) else node.body
    return _name(node).lower().startswith("assert")


def _checks(fn: ast.AST) -> bool:
    """Whether ``fn``'s body has an assert, a pytest check or a checking call."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if name.startswith(CHECKS) or name.lower().startswith("assert"):
                return True
            if (isinstance(node.func, ast.Attribute) and name in PYTEST_CHECKS
                    and _name(node.func.value) == "pytest"):
                return True
    return False


def offences(source: str) -> list[tuple[int, str, str]]:
    """``(line, kind, function)`` of every assertion of ``source`` that cannot
    fail (in tests and in their helpers: ``function`` is the enclosing
    module-level function or test method) and every test in it that checks
    nothing. A value computed twice with nothing in between (`_twins`, or
    ``a = f(x)`` right before the check that computes ``f(x)`` again) is
    one expression.

    Example:
      >>> offences("def test_a():\\n    x = 1\\n    assert x == x\\n")
      [(3, 'same-sides', 'test_a')]
    """
    tree = ast.parse(source)
    found = [(fn.lineno, "no-check", fn.name) for fn in _functions(tree, "Test")
             if fn.name.startswith("test") and not _checks(fn)]
    for fn in _functions(tree):
        once = _bound_once(fn)
        twins = _twins(fn, once)
        for block in _blocks(fn):
            for before, stmt in zip([ast.Pass(), *block], block):
                names = {**twins, **{n: _expanded(v, {}) for n, v in _assigned(before).items()
                                     if n in once}}
                for node in _own_nodes(stmt):
                    found += [(line, kind, fn.name) for line, kind in _node_offences(node, names)]
    return sorted(set(found))


def _functions(tree: ast.Module, classes: str = ""):
    """Module-level functions and the methods of the module-level classes
    whose names start with ``classes`` (``"Test"``: those pytest collects)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef) and node.name.startswith(classes):
            yield from (n for n in node.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _own_nodes(stmt: ast.stmt):
    """The nodes of ``stmt`` outside the statements nested in it."""
    todo = [stmt]
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt)]


def _node_offences(node: ast.AST, names: dict[str, str]) -> list[tuple[int, str]]:
    """The offences of one node (`_same` reads ``names``)."""
    out = []
    if isinstance(node, ast.Assert):
        if _truthy_constant(node.test):
            out.append((node.lineno, "constant"))
        if any(_reflexive(c, names) for c in ast.walk(node.test)
               if isinstance(c, ast.Compare)):
            out.append((node.lineno, "same-sides"))
        if any(isinstance(c, ast.Call) and _name(c.func) in CLOSE and len(c.args) >= 2
               and _same(c.args[0], c.args[1], names) for c in ast.walk(node.test)):
            out.append((node.lineno, "same-args"))
    elif isinstance(node, ast.Call) and _same_args(node, names):
        out.append((node.lineno, "same-args"))
    elif (isinstance(node, ast.Call) and _name(node.func) in {"assertTrue", "assert_"}
          and node.args and _truthy_constant(node.args[0])):
        out.append((node.lineno, "constant"))
    return out


def _reflexive(compare: ast.Compare, names: dict[str, str]) -> bool:
    """``a == a`` (or ``is``, ``<=``, ``>=``, or ``a == pytest.approx(a)``): a
    comparison chain whose every link is one (``a == a == b`` can fail)."""
    sides = [compare.left, *compare.comparators]
    return all(isinstance(op, REFLEXIVE) and (
        _same(a, b, names) or _same(a, _approxed(b), names) or _same(_approxed(a), b, names))
               for op, a, b in zip(compare.ops, sides, sides[1:]))


def _approxed(node: ast.AST) -> ast.AST:
    """``x`` of ``pytest.approx(x, ...)``, else ``node``."""
    if isinstance(node, ast.Call) and _name(node.func) == "approx" and node.args:
        return node.args[0]
    return node


def _report(path: pathlib.Path) -> list[str]:
    """``file:line: kind (test)`` of each offence in ``path`` not in `ALLOWED`."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    return [f"{rel}:{line}: {kind} in {test}: {lines[line - 1].strip()}"
            for line, kind, test in offences(path.read_text())
            if ALLOWED.get(f"{path.name}::{test}", ("",))[0] != kind]


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_every_assertion_can_fail_and_every_test_checks(path):
    found = _report(path)
    assert not found, "assertions that cannot fail or tests that check nothing:\n" + "\n".join(
        found)


def test_the_allow_list_names_tests_that_exist_and_offend():
    """An allowed entry is a test of that file with an offence of the kind
    it names, and gives its reason: a stale entry is an error."""
    for entry, (kind, reason) in ALLOWED.items():
        file, test = entry.split("::")
        kinds = {k for _, k, t in offences((ROOT / "tests" / file).read_text()) if t == test}
        assert kind in kinds and kind in {"same-sides", "same-args", "no-check"}, entry
        assert len(reason) > 20, entry


def test_the_audit_finds_each_kind_and_passes_real_checks():
    """Each kind on a source made for it, and none on tests that do check:
    every offending line of the source says its kind after ``# !``."""
    source = '''
import numpy as np, jax, pytest

def test_same():
    y = f(1)
    assert f(1) == f(1)  # !same-sides
    assert y <= y  # !same-sides
    assert 0 <= y <= y
    np.testing.assert_allclose(y, y, rtol=1e-6)  # !same-args
    self.assertEqual(g(y), g(y))  # !same-args
    np.testing.assert_array_equal(actual=y, desired=y)  # !same-args
    jax.tree.map(np.testing.assert_array_equal, t, t)  # !same-args
    assert np.allclose(h(y), h(y)) or y == pytest.approx(y)  # !same-args !same-sides

def test_constants():
    assert True  # !constant
    assert (y > 0, "y is positive")  # !constant
    assert f"{y}"  # !constant
    self.assertTrue("yes")  # !constant

def test_nothing():  # !no-check
    y = f(1)
    print(y)

def test_twice():
    a, b = f(1), f(1)
    assert a == b  # !same-sides
    c = g(2)
    np.testing.assert_array_equal(c, g(2))  # !same-args

def test_real(tmp_path):
    assert f(1) == 2
    np.testing.assert_allclose(f(1), g(1))
    jax.tree.map(np.testing.assert_array_equal, f(1), g(1))
    assert not ()
    t, u = zeros(3), zeros(3)
    t[0] += 1
    assert t != u and not t == u
    v = h(1)
    patch()
    w = h(1)
    assert v == w

def test_raises():
    with pytest.raises(ValueError):
        f(-1)

def test_helper():
    check_round_trip(f)

class TestGroup:
    def test_method(self):  # !no-check
        pass
'''
    marked = sorted((i, kind, fn) for fn, lines in _marks(source).items()
                    for i, kinds in lines for kind in kinds)
    assert offences(source) == marked


def _marks(source: str) -> dict[str, list[tuple[int, list[str]]]]:
    """Per test of ``source``, its lines marked ``# !kind`` and their kinds."""
    out: dict[str, list[tuple[int, list[str]]]] = {}
    fn = ""
    for i, line in enumerate(source.splitlines(), start=1):
        if line.lstrip().startswith("def "):
            fn = line.split("def ")[1].split("(")[0]
        comment = line.split("# ", 1)[1] if "# !" in line else ""
        kinds = [word[1:] for word in comment.split() if word.startswith("!")]
        if kinds:
            out.setdefault(fn, []).append((i, kinds))
    return out


def test_the_examples_of_this_module_run():
    import doctest
    import sys

    result = doctest.testmod(sys.modules[__name__])
    assert result.attempted >= 1 and result.failed == 0
