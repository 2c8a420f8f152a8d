"""``python -m kvrag.cli …``: the same as the ``kvrag`` command."""

import sys

from kvrag.cli import main

sys.exit(main())
