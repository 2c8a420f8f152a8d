"""numba's CPU target started without SciPy's BLAS, in a process whose only compiled code is kvrag's.

Contract: after `only_kvrag_compiles()`, `start()` imports numba and starts its CPU target (which the first compiled
call of a process would otherwise do) without SciPy's BLAS, once; without it, `start()` does nothing and numba
starts as numba does. Starting the target imports numba's NumPy support, which asks for
``scipy.linalg.cython_blas`` so that ``np.correlate`` and ``np.convolve`` in compiled code can call BLAS: with SciPy
1.17 installed that import took 0.36 s of a cold ``kvrag ask`` (about a tenth of it), and no kvrag kernel calls
either function. So the import is refused while the target starts (numba then compiles those two functions with
its own loop) and allowed again at once: SciPy, and every module that needs its BLAS, import as before. Only the
``kvrag`` command calls `only_kvrag_compiles`, in its own process (``kvrag ask``); `kvrag.model.cpu_linear` calls
`start` before loading its kernel, the first compiled call of a decoding model.
"""

from __future__ import annotations

import sys
import threading

_BLAS = "scipy.linalg.cython_blas"
_alone = False
_started = False
_lock = threading.Lock()


def only_kvrag_compiles() -> None:
    """Say that no compiled code but kvrag's runs in this process (the ``kvrag`` command's own)."""
    global _alone
    _alone = True


def start() -> None:
    """Start numba's CPU target without SciPy's BLAS, once, after `only_kvrag_compiles` (see the module docstring)."""
    global _started
    with _lock:
        if _started or not _alone:
            return
        _started = True
        blocked = _BLAS not in sys.modules
        if blocked:
            sys.modules[_BLAS] = None  # type: ignore[assignment]  # importing it raises ImportError meanwhile
        try:
            from numba.core.registry import cpu_target

            cpu_target.target_context.refresh()
        finally:
            if blocked and _BLAS in sys.modules and sys.modules[_BLAS] is None:
                del sys.modules[_BLAS]
