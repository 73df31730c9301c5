"""``python -m conformance.context_parallel``: the context-parallel checks (``run.main``); also
how ``run`` starts its JAX and torch workers (``--worker jax|torch``)."""

from __future__ import annotations

import sys

from ..usage import exit_code_of
from .run import main

if __name__ == "__main__":
    sys.exit(exit_code_of(main))
