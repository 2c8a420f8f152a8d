"""Local model and embedder folders this user has built indexes from, trusted when an index names them.

Contract: an index's manifest is not signed, so a path it names outside the index could load anything a user can
read. Opening an index loads a model or embedder from such a path only if the caller names it (``model=`` /
``embedder=``, ``--model`` / ``--embedder``) or this user built an index from it on this machine: `trust` records
the resolved path when a manifest is written (`kvrag.indexing.manifest.new_manifest`), in ``trusted-paths.txt``
under `kvrag.user_cache.default_cache_dir`, one path a line; `trusted` reads it. A file that cannot be written or
read trusts nothing more (opening then needs the path named).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvrag.user_cache import default_cache_dir

log = logging.getLogger(__name__)
FILE = "trusted-paths.txt"


def _file() -> Path:
    return default_cache_dir() / FILE


def trusted(path: Path) -> bool:
    """Whether this user built an index from the local folder or file ``path`` (resolved) on this machine."""
    try:
        lines = _file().read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    return str(path.resolve()) in lines


def trust(path: Path) -> None:
    """Record the local folder or file ``path`` as one this user built an index from."""
    resolved = path.resolve()
    if trusted(resolved):
        return
    try:
        _file().parent.mkdir(parents=True, exist_ok=True)
        with _file().open("a", encoding="utf-8") as fh:  # one short append: whole lines, even from two processes
            fh.write(f"{resolved}\n")
    except OSError as exc:
        log.warning("cannot record %s as a trusted model path (%s); opening its indexes will need it named", path, exc)
