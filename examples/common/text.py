"""A byte-level text corpus that ships with Python: the standard library's source.

`load_stdlib` reads every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``
(nothing is downloaded), one document per file, sorted by relative path,
leaving out what is not the same text on every installation of one Python
version (`is_portable`): ``site-packages`` / ``dist-packages``, the build's
``config-*`` folder and ``_sysconfigdata_*`` module, ``sitecustomize`` /
``usercustomize``, and every test: folders ``test/``, ``tests/``,
``idle_test/`` and files ``test_*``. A document is in the validation split
when ``zlib.crc32`` of its relative path falls in the first ``val_percent``
of 100 (`is_validation`): a split by document, fixed by the path alone, so a
file added or removed never moves another. Each split is its documents
joined in path order, one NUL byte after each, as ``np.uint8``;
`Corpus.describe` gives the Python version, file counts, bytes and a
SHA-256 of the two texts, so a run elsewhere can check it trains on the same
bytes. CPython 3.11.7 has 732 such files, 12,079,736 bytes, 55 of them
(857,368 bytes) for validation (``examples/lm/README.md``).

`NextBytes` is the `common.task.Task` of next-byte prediction: training
batches of random windows of ``context + 1`` bytes of the training text,
the same for a given seed and step, and a fixed set of validation windows,
evenly spaced and disjoint, on which `NextBytes.evaluate` reports bits per
byte.

Example:
  >>> corpus = load_stdlib()                                    # doctest: +SKIP
  >>> corpus.describe()["files"], len(corpus.train) > len(corpus.val)   # doctest: +SKIP
  (732, True)
  >>> x, y = next(NextBytes(corpus, context=64).batches(8, 1, seed=0))   # doctest: +SKIP
  >>> x.shape, (x[:, 1:] == y[:, :-1]).all()                      # doctest: +SKIP
  ((8, 64), True)
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import platform
import sysconfig
import zlib
from typing import NamedTuple

import numpy as np

VAL_PERCENT = 5
SEPARATOR = b"\0"
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SKIPPED_TOP = frozenset({"site-packages", "dist-packages", "__pycache__",
                          "sitecustomize.py", "usercustomize.py"})


def is_portable(path: str) -> bool:
    """Whether the stdlib file at relative POSIX ``path`` is in the corpus.

    Example:
      >>> [is_portable(p) for p in ("json/decoder.py", "test/test_json.py",
      ...     "unittest/test/test_case.py", "lib2to3/tests/data/bom.py",
      ...     "site-packages/six.py", "_sysconfigdata__linux_x86_64-linux-gnu.py",
      ...     "config-3.11-x86_64-linux-gnu/python-config.py", "sqlite3/test_x.py")]
      [True, False, False, False, False, False, False, False]
    """
    parts = pathlib.PurePosixPath(path).parts
    name = parts[-1]
    return (name.endswith(".py") and parts[0] not in _SKIPPED_TOP
            and not parts[0].startswith("config-")
            and not _TEST_DIRS.intersection(parts[:-1]) and "__pycache__" not in parts
            and not name.startswith(("test_", "_sysconfigdata")))


def is_validation(path: str, percent: int = VAL_PERCENT) -> bool:
    """Whether the document at relative POSIX ``path`` is held out for validation.

    Example:
      >>> is_validation("json/decoder.py"), is_validation("json/decoder.py", percent=100)
      (False, True)
    """
    return zlib.crc32(path.encode()) % 100 < percent


def source_files(root) -> list[str]:
    """The corpus's files under ``root``: relative POSIX paths, sorted (symbolic
    links to folders are not followed)."""
    root = pathlib.Path(root)
    found = []
    for folder, _, names in os.walk(root):
        rel = pathlib.Path(folder).relative_to(root)
        found += [(rel / n).as_posix() for n in names if is_portable((rel / n).as_posix())]
    return sorted(found)


class Corpus(NamedTuple):
    """The two texts (read-only ``np.uint8``) and where they come from."""

    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    root: str
    python: str
    sha256: str

    def describe(self) -> dict:
        """JSON-ready facts: source, Python version, files and bytes per split
        (one NUL per file included), SHA-256 of the training then the validation text."""
        stdlib = self.root == sysconfig.get_paths()["stdlib"]
        return {"source": f"Python {self.python} standard library" if stdlib else self.root,
                "python": self.python, "root": self.root,
                "files": len(self.train_files) + len(self.val_files),
                "train_files": len(self.train_files), "val_files": len(self.val_files),
                "train_bytes": int(self.train.size), "val_bytes": int(self.val.size),
                "sha256": self.sha256}


def _join(root: pathlib.Path, files) -> bytes:
    return b"".join((root / f).read_bytes() + SEPARATOR for f in files)


def load_stdlib(root: str | None = None, val_percent: int = VAL_PERCENT) -> Corpus:
    """The standard library of this Python (or the ``.py`` files under ``root``),
    split by document (read in about a second).

    Raises:
      FileNotFoundError: no file of the corpus under ``root``.
    """
    folder = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = source_files(folder)
    if not files:
        raise FileNotFoundError(f"no Python source files under {folder}")
    val_files = tuple(f for f in files if is_validation(f, val_percent))
    train_files = tuple(f for f in files if not is_validation(f, val_percent))
    train, val = _join(folder, train_files), _join(folder, val_files)
    arrays = [np.frombuffer(text, np.uint8) for text in (train, val)]  # read-only views
    return Corpus(arrays[0], arrays[1], train_files, val_files, str(folder),
                  platform.python_version(), hashlib.sha256(train + val).hexdigest())


def windows(text: np.ndarray, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-byte targets (int32, ``(len(starts), length)``) of the
    windows of ``length + 1`` bytes of ``text`` at ``starts``."""
    rows = text[np.asarray(starts)[:, None] + np.arange(length + 1)].astype(np.int32)
    return rows[:, :-1], rows[:, 1:]


class NextBytes:
    """Next-byte prediction on a `Corpus`, as a `common.task.Task`.

    Args:
      corpus: the texts.
      context: bytes the model sees per window (it predicts each next one).
      val_windows: validation windows (fewer when the validation text is
        shorter than that many disjoint windows).
    """

    metric = "bpb"

    def __init__(self, corpus: Corpus, context: int, val_windows: int = 256):
        if not 1 <= context < min(corpus.train.size, corpus.val.size):
            raise ValueError(f"context must be in [1, {min(corpus.train.size, corpus.val.size)}),"
                             f" got {context!r}")
        self.corpus, self.context = corpus, context
        count = max(1, min(val_windows, corpus.val.size // (context + 1)))
        starts = np.linspace(0, corpus.val.size - context - 1, count).round().astype(np.int64)
        self.x_val, self.y_val = windows(corpus.val, starts, context)

    @property
    def train_size(self) -> int:
        """Windows in one pass over the training text."""
        return self.corpus.train.size // self.context

    def batches(self, global_batch: int, steps: int, seed: int, start: int = 0):
        """Global batches ``start .. steps - 1``: ``global_batch`` windows at
        uniform random offsets drawn from ``(seed, step)``."""
        high = self.corpus.train.size - self.context
        for i in range(start, steps):
            rng = np.random.default_rng([seed, i])
            yield windows(self.corpus.train, rng.integers(0, high, global_batch), self.context)

    def evaluate(self, dp, params) -> float:
        """Validation loss in bits per byte (nats / ln 2) of ``dp``'s model."""
        return dp.mean_loss(params, self.x_val, self.y_val) / math.log(2)
