"""Where two attention blocks part: ``locate(a, b, inputs)`` and ``python -m conformance locate``.

Two attention blocks (the spec's ``MultiHeadAttention`` of any backend, a plugin's module with
``stages``, or a transformers attention layer wrapped with hooks) run on the same seeded
inputs with the same weights; their intermediate tensors are compared stage by stage with the
harness's one tolerance rule, and the first stage that parts is named, with its error per
sequence position and the smallest input that still shows it.

=================  =========================================================================
``blocks``         what an attention block is: the adapters (``stages``, a transformers layer
                   with hooks), float64 NumPy in one layout, copying weights from one to the
                   other
``locate``         ``locate``: the stage-by-stage comparison, the verdict on positions, the
                   shrunk input; ``LocateInputs``, ``LocateResult``
``render``         the result as text, for the command line
``cli``            ``python -m conformance locate A B``: the names of blocks, the exit code
=================  =========================================================================

NumPy only at import; the frameworks are imported when a block needs them.
"""

from __future__ import annotations

from .blocks import STAGES, BadBlock
from .locate import LocateInputs, LocateResult, StageError, locate

__all__ = ["STAGES", "BadBlock", "LocateInputs", "LocateResult", "StageError", "locate"]
