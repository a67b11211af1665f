"""transforms: optax GradientTransformations built on qcollect's public API.

Installed by the qcollect distribution (``pip install "qcollect[optax]"``).
"""

__all__: list[str] = []
