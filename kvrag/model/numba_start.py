"""numba's CPU target started without SciPy's BLAS, in a process whose only compiled code is kvrag's.

Contract: after `only_kvrag_compiles()`, the block `with without_blas():` refuses ``import scipy.linalg.cython_blas``
(it raises ImportError) and allows it again on leaving; without it, the block does nothing. The first compiled call
of a process starts numba's CPU target, which imports numba's NumPy support, which asks for SciPy's BLAS so that
``np.correlate`` and ``np.convolve`` in compiled code can call it: with SciPy 1.17 installed that import took 0.36 s
of a cold ``kvrag ask`` (about a tenth of it), and no kvrag kernel calls either function. Made inside the block,
that first call starts the target without it (numba then compiles those two functions with its own loop), and
SciPy, and every module that needs its BLAS, import as before once the block ends. Only the ``kvrag`` command calls
`only_kvrag_compiles`, in its own process (``kvrag ask``); `kvrag.model.cpu_linear` makes its kernel's first call,
the first compiled call of a decoding model, inside the block.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

_BLAS = "scipy.linalg.cython_blas"
_alone = False


def only_kvrag_compiles() -> None:
    """Say that no compiled code but kvrag's runs in this process (the ``kvrag`` command's own)."""
    global _alone
    _alone = True


@contextmanager
def without_blas() -> Iterator[None]:
    """Refuse SciPy's BLAS inside the block, after `only_kvrag_compiles` (see the module docstring)."""
    blocked = _alone and _BLAS not in sys.modules
    if blocked:
        sys.modules[_BLAS] = None  # type: ignore[assignment]  # importing it raises ImportError meanwhile
    try:
        yield
    finally:
        if blocked and _BLAS in sys.modules and sys.modules[_BLAS] is None:
            del sys.modules[_BLAS]
