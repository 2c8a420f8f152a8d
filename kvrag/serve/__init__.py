"""``kvrag serve``: an OpenAI-compatible HTTP server over an opened kvrag index.

Contract: importing this package loads neither FastAPI, uvicorn nor prometheus-client; `create_app`,
`run_server` and `ServeOptions` (from `kvrag.serve.app`) load them on first use and raise one
`ImportError` naming ``pip install 'kvrag[serve]'`` when they are missing. `check_installed` raises the
same error up front, before a model is loaded. The modules: `kvrag.serve.openai_schema` (the wire
format), `kvrag.serve.scheduler` (the worker thread that owns the model), `kvrag.serve.completions`
(the chat route), `kvrag.serve.metrics` (Prometheus) and `kvrag.serve.app` (the app and the routes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvrag.lazy import lazy_exports

if TYPE_CHECKING:
    from kvrag.serve.app import ServeOptions, create_app, run_server

__all__ = ["ServeOptions", "check_installed", "create_app", "run_server"]

REQUIRED = ("fastapi", "uvicorn", "prometheus_client")
INSTALL_HINT = "kvrag serve needs FastAPI, uvicorn and prometheus-client: pip install 'kvrag[serve]'"


def check_installed() -> None:
    """Raise `ImportError` naming ``pip install 'kvrag[serve]'`` unless the server's dependencies import."""
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"{INSTALL_HINT} ({name} is missing)") from exc


__getattr__ = lazy_exports(__name__, dict.fromkeys(("ServeOptions", "create_app", "run_server"), "kvrag.serve.app"))
