"""Benchmark options read as text, checked against the argument types they set.

A benchmark reads ``pairwise``, ``all_to_all`` or a method's ``@always`` from
its command line; these helpers return the option itself, typed as the
argument of `qcollect.compressed_all_reduce` it sets (`qcollect.Algorithm`,
`qcollect.Exchange`, `qcollect.BatchBuckets`), or raise a ValueError that
names the choices, so that a misspelt option fails where it is read rather
than inside a traced program. The module imports nothing of JAX, so that a
benchmark's parent process can check its options before it starts workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeVar, get_args

if TYPE_CHECKING:
    import qcollect as qc

__all__ = ["BATCH_WORDS", "BatchWord", "algorithm", "choose", "exchange", "parse_batch_buckets"]

Option = TypeVar("Option", bound=str)
#: The words that `qcollect.BatchBuckets` accepts besides an int.
BatchWord = Literal["auto", "always", "never"]
BATCH_WORDS: tuple[BatchWord, ...] = get_args(BatchWord)


def choose(name: str, text: str, options: tuple[Option, ...]) -> Option:
    """The option of ``options`` that ``text`` spells, typed as the options are.

    Raises:
      ValueError: ``text`` is none of them; the message names ``name`` and
        the options.

    Example:
      >>> choose("path", "transform", ("collective", "transform"))
      'transform'
    """
    for option in options:
        if text == option:
            return option
    raise ValueError(f"{name} must be one of {', '.join(options)}, got {text!r}")


def parse_batch_buckets(text: str) -> qc.BatchBuckets:
    """A method's ``@B`` suffix as ``batch_buckets``: ``auto``, ``always``,
    ``never`` or an int >= 0 (`qcollect.runs_batched`).

    Raises:
      ValueError: any other text.

    Example:
      >>> parse_batch_buckets("always"), parse_batch_buckets("16")
      ('always', 16)
    """
    if text.isdigit():
        return int(text)
    if text not in BATCH_WORDS:
        raise ValueError(f"batch_buckets must be 'auto', 'always', 'never' or an int >= 0, "
                         f"got {text!r}")
    return choose("batch_buckets", text, BATCH_WORDS)


def algorithm(text: str) -> qc.Algorithm:
    """``text`` as `qcollect.compressed_all_reduce`'s ``algorithm``: ``"auto"``
    or one of `qcollect.ALGORITHMS`.

    Raises:
      ValueError: any other text.
    """
    import qcollect as qc

    return choose("algorithm", text, get_args(qc.Algorithm))


def exchange(text: str) -> qc.Exchange:
    """``text`` as the collectives' ``exchange``: one of `qcollect.EXCHANGES`.

    Raises:
      ValueError: any other text.
    """
    import qcollect as qc

    return choose("exchange", text, get_args(qc.Exchange))
