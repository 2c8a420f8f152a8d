"""``python -m kvrag.cli …``: the same as the ``kvrag`` command."""

from kvrag.cli import console

console()
