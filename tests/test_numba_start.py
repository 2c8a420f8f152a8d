"""`kvrag.model.numba_start`: numba's CPU target started without SciPy's BLAS only where the process said that only
kvrag compiles, with kvrag's kernels still exact and SciPy's BLAS importable right after.

Each case runs in a fresh interpreter: numba's target starts once per process.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

BLAS = "scipy.linalg.cython_blas"


def _python(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_process_that_says_only_kvrag_compiles_starts_numba_without_scipys_blas():
    has_scipy = importlib.util.find_spec("scipy") is not None
    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "from kvrag.model import cpu_linear, numba_start\n"
        "numba_start.only_kvrag_compiles()\n"
        "x, w = torch.randn(1, 64), torch.randn(96, 64)\n"
        "out = cpu_linear.linear(x, w)\n"
        "print(cpu_linear.kernel_threads() is not None, torch.allclose(out, F.linear(x, w), atol=1e-5),\n"
        f"      {BLAS!r} in sys.modules)\n"
        f"if {has_scipy}:\n"
        f"    import {BLAS}\n"
        "    print('importable')\n"
    )
    assert _python(code) == ["True", "True", "False"] + (["importable"] if has_scipy else [])


def test_any_other_process_starts_numba_as_numba_does():
    code = ("import sys\nfrom kvrag.model import numba_start\n"
            "with numba_start.without_blas():\n"
            f"    print({BLAS!r} in sys.modules and sys.modules[{BLAS!r}] is None)\n")
    assert _python(code) == ["False"]  # nothing refused
