"""Error feedback as a value: which memory a compressed all-reduce keeps.

A strategy is a frozen dataclass, like a compressor: equal settings, equal
strategy. It says which leaves keep state (`init`), which keep the owner's
re-encoding error (`keeps_owner`), and gives the warm-up and compressed step
(`steps`) over its own state type, so no state field changes meaning with a
setting:

* `transforms.residual_feedback()` (the default): Seide's residual,
  `ResidualState` (`transforms._residual`);
* `transforms.ef21(momentum=None)`: EF21's estimates, and with ``momentum``
  EF21-SGDM's, `EF21State` (`transforms._ef21`);
* ``None``: no error feedback (a `ResidualState` whose leaves are all
  masked).

`feedback_from` turns the older spellings (``True``, ``False``,
``"residual"``, ``"none"``, ``"ef21"`` with ``ef21_momentum``) into these,
with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Union

import jax

import qcollect as qc
from qcollect.checks import check_float
from transforms._ef21 import Context, EF21State, ef21_steps
from transforms._residual import ResidualState, residual_steps
from transforms._state import zeros_or_masked

__all__ = ["EF21", "Feedback", "ResidualFeedback", "ef21", "feedback_from", "keeps_residual",
           "residual_feedback"]

#: ``(exact, compressed)`` step functions ``(leaves, memory, key, count) -> (updates, memory)``.
Steps = tuple[Callable[..., Any], Callable[..., Any]]


def _tree(treedef: Any, leaves: list[Any], keep: list[bool]) -> Any:
    return treedef.unflatten([zeros_or_masked(leaf, k) for leaf, k in zip(leaves, keep,
                                                                           strict=True)])


@dataclasses.dataclass(frozen=True)
class ResidualFeedback:
    """Seide's residual error feedback (`transforms.residual_feedback`)."""

    keep: bool = dataclasses.field(default=True, repr=False)
    #: The type of the state it keeps.
    state: ClassVar[type] = ResidualState

    def check(self, algorithm: str) -> None:
        """Every algorithm suits the residual."""

    def keeps_owner(self, algorithm: str, compressor: qc.Compressor) -> bool:
        """The owner's re-encoding error is kept with ``algorithm="pairwise"``."""
        return self.keep and algorithm == "pairwise"

    def init(self, params: Any, comps: list[qc.Compressor | None],
             algorithm: str) -> ResidualState:
        """Zeros for the compressed leaves' residuals (and owner residuals)."""
        leaves, treedef = jax.tree.flatten(params)
        return ResidualState(
            residual=_tree(treedef, leaves, [self.keep and c is not None for c in comps]),
            owner_residual=_tree(treedef, leaves, [c is not None and self.keeps_owner(
                algorithm, c) for c in comps]))

    def steps(self, ctx: Context) -> Steps:
        """The warm-up and the compressed step (`transforms._residual`)."""
        return residual_steps(ctx, keep=self.keep)


@dataclasses.dataclass(frozen=True)
class EF21:
    """EF21's estimator, EF21-SGDM's with ``momentum`` (`transforms.ef21`)."""

    momentum: float | None = None
    #: The type of the state it keeps.
    state: ClassVar[type] = EF21State

    def __post_init__(self) -> None:
        eta = check_float("momentum", self.momentum, low=0.0, high=1.0, allow_none=True)
        object.__setattr__(self, "momentum", None if eta is None else float(eta))

    def check(self, algorithm: str) -> None:
        """Raises ValueError for ``"ring_requantize"``, whose errors belong to no device."""
        if algorithm == "ring_requantize":
            raise ValueError(
                "error_feedback=transforms.ef21() needs an all-reduce whose value is what the "
                "devices contributed; algorithm='ring_requantize' re-encodes at every hop, "
                "errors that belong to no device, so the estimate would drift (use 'auto' "
                "or 'pairwise')")

    def keeps_owner(self, algorithm: str, compressor: qc.Compressor) -> bool:
        """The owner's error is kept wherever the compressor runs pairwise
        (``"pairwise"``, or ``"auto"`` with a non-linear compressor)."""
        return algorithm == "pairwise" or (algorithm == "auto" and not compressor.linear)

    def init(self, params: Any, comps: list[qc.Compressor | None],
             algorithm: str) -> EF21State:
        """Zeros for the compressed leaves' estimates, owner errors and momenta."""
        leaves, treedef = jax.tree.flatten(params)
        compressed = [c is not None for c in comps]
        return EF21State(
            local_estimate=_tree(treedef, leaves, compressed),
            estimate=_tree(treedef, leaves, compressed),
            owner_residual=_tree(treedef, leaves, [c is not None and self.keeps_owner(
                algorithm, c) for c in comps]),
            momentum=_tree(treedef, leaves, [k and self.momentum is not None
                                             for k in compressed]))

    def steps(self, ctx: Context) -> Steps:
        """EF21's warm-up and compressed step (`transforms._ef21`)."""
        return ef21_steps(ctx, eta=self.momentum)


#: ``error_feedback=`` of `transforms.compressed_all_reduce`: a strategy, or None.
Feedback = Union[ResidualFeedback, EF21, None]


def residual_feedback() -> ResidualFeedback:
    """Seide's residual error feedback: each device keeps what its encodings
    did not send, ``input - contributed``, and adds it to the next gradient.

    The default of `transforms.compressed_all_reduce`; its state is a
    `ResidualState` (with ``algorithm="pairwise"`` also the owner's error).

    References:
      Seide et al., INTERSPEECH 2014; Grubic et al., EDBT 2018, Algorithm 2.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc, transforms
      >>> tx = transforms.compressed_all_reduce(
      ...     "data", compressor=qc.onebit(), key=jax.random.key(0),
      ...     error_feedback=transforms.residual_feedback())
      >>> type(tx.init({"w": jnp.zeros((4, 4))}).feedback).__name__
      'ResidualState'
    """
    return ResidualFeedback()


def ef21(*, momentum: float | None = None) -> EF21:
    """EF21's error feedback: each device keeps an estimate ``g_i`` of its
    gradient and sends ``C(grad_i - g_i)``; the update is their mean ``g``.

    Args:
      momentum: EF21-SGDM's ``eta`` in ``(0, 1]``: each device compresses
        its momentum ``v_i = (1 - eta) v_i + eta grad_i`` instead (the
        gradient itself at the first step); None (default): plain EF21.

    Returns:
      A strategy for ``error_feedback=`` of `transforms.compressed_all_reduce`;
      its state is an `EF21State`.

    Raises:
      ValueError: ``momentum`` outside ``(0, 1]``.

    References:
      Richtárik, Sokolov and Fatkhullin, EF21, NeurIPS 2021, Algorithm 1;
      Fatkhullin, Tyurin and Richtárik, EF21-SGDM, NeurIPS 2023, Algorithm 1.

    Example:
      >>> import transforms
      >>> transforms.ef21(momentum=0.9) == transforms.ef21(momentum=0.9)
      True
    """
    return EF21(momentum=momentum)


_NONE = ResidualFeedback(keep=False)
#: The older spellings: what each means, and its new spelling.
_OLD: dict[object, tuple[ResidualFeedback | EF21, str]] = {
    True: (ResidualFeedback(), "transforms.residual_feedback()"),
    "residual": (ResidualFeedback(), "transforms.residual_feedback()"),
    False: (_NONE, "None"), "none": (_NONE, "None"), "ef21": (EF21(), "transforms.ef21()")}


def feedback_from(error_feedback: object, ef21_momentum: object = None
                  ) -> ResidualFeedback | EF21:
    """The strategy ``error_feedback`` names; the older spellings (True,
    False, ``"residual"``, ``"none"``, ``"ef21"``, and ``ef21_momentum``)
    with a DeprecationWarning that gives the new one.

    Raises:
      ValueError: ``error_feedback`` is neither a strategy, None nor an older
        spelling; ``ef21_momentum`` out of range or without EF21.
    """
    if ef21_momentum is not None:
        warnings.warn("ef21_momentum is deprecated: pass error_feedback=transforms.ef21("
                      "momentum=...)", DeprecationWarning, stacklevel=3)
        eta = check_float("ef21_momentum", ef21_momentum, low=0.0, high=1.0)
        if error_feedback not in ("ef21",) and not isinstance(error_feedback, EF21):
            raise ValueError(f"ef21_momentum is EF21-SGDM's momentum and needs EF21, got "
                             f"error_feedback={error_feedback!r}; pass error_feedback="
                             f"transforms.ef21(momentum={eta})")
        if isinstance(error_feedback, EF21) and error_feedback.momentum not in (None, eta):
            raise ValueError(f"ef21_momentum={eta} and error_feedback={error_feedback!r} "
                             "disagree; pass the momentum once, to transforms.ef21")
        return EF21(momentum=eta)
    if error_feedback is None:
        return _NONE
    if isinstance(error_feedback, (ResidualFeedback, EF21)):
        return error_feedback
    if isinstance(error_feedback, (bool, str)) and error_feedback in _OLD:
        strategy, spelling = _OLD[error_feedback]
        warnings.warn(f"error_feedback={error_feedback!r} is deprecated: pass "
                      f"error_feedback={spelling}", DeprecationWarning, stacklevel=3)
        return strategy
    raise ValueError(f"error_feedback must be transforms.residual_feedback(), "
                     f"transforms.ef21(...) or None, got {error_feedback!r}")


def keeps_residual(error_feedback: object, owner: str) -> bool:
    """Whether a transformation that keeps only Seide's residual (``owner``:
    ``"powersgd"``, ``"gradiveq"``, ``"fsdp"``) keeps it: True for
    `transforms.residual_feedback()`, False for None; True and False are
    deprecated spellings of those (DeprecationWarning).

    Raises:
      ValueError: another strategy (EF21) or value, naming ``error_feedback``.
    """
    if isinstance(error_feedback, bool):
        warnings.warn(f"{owner}(error_feedback={error_feedback!r}) is deprecated: pass "
                      f"error_feedback={_OLD[error_feedback][1]}", DeprecationWarning,
                      stacklevel=3)
        return error_feedback
    if error_feedback is None:
        return False
    if isinstance(error_feedback, ResidualFeedback):
        return error_feedback.keep
    raise ValueError(f"error_feedback of {owner} must be transforms.residual_feedback() or "
                     f"None (it keeps Seide's residual only), got {error_feedback!r}")
