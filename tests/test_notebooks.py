"""The notebooks execute (quick mode) and the committed ones keep their full-mode plots."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]


def _runner():
    spec = importlib.util.spec_from_file_location("notebooks_run", NOTEBOOKS_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _has_png(nb) -> bool:
    return any("image/png" in out.get("data", {})
               for cell in _code_cells(nb) for out in cell.get("outputs", []))


def _mode(nb) -> str | None:
    """What the first code cell printed: ``"full"`` or ``"quick"`` (None if nothing)."""
    cells = _code_cells(nb)
    text = "".join(out.get("text", "") for out in cells[0].get("outputs", [])
                   if out.get("output_type") == "stream") if cells else ""
    for line in text.splitlines():
        if line.startswith("mode:"):
            return line.split(":", 1)[1].strip()
    return None


def test_notebooks_found():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


# quantizers (30 s) and training (a training run, as tests/test_examples.py runs the
# example it wraps) run under -m slow.
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow)
                                  if p.stem in ("quantizers", "training")
                                  else p for p in NOTEBOOKS], ids=IDS)
def test_notebook_executes_quick(path, tmp_path):
    committed = path.read_bytes()
    out = tmp_path / path.name
    # CellExecutionError propagates if any cell raises.
    nb = _runner().execute(path, quick=True, write_to=out)
    assert path.read_bytes() == committed, "the committed notebook was modified"
    assert out.exists()
    assert _mode(nb) == "quick"
    errors = [o for c in _code_cells(nb) for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    assert _has_png(nb), "no cell produced an image/png output"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_notebook_has_full_outputs(path):
    nb = nbformat.read(path, as_version=4)
    missing = [i for i, c in enumerate(nb.cells)
               if c.cell_type == "code" and c.source.strip() and not c.get("outputs")]
    assert not missing, f"code cells without outputs (run python notebooks/run.py): {missing}"
    errors = [o for c in _code_cells(nb) for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, "the committed notebook holds an error output"
    assert _has_png(nb), "the committed notebook has no PNG output"
    assert _mode(nb) == "full", "committed in quick mode; run python notebooks/run.py"
