"""`parse_bytes`: one reading of a size in bytes for every bound kvrag takes (``*_bytes`` arguments, fields, URL
options and flags).

A size is an int of bytes, or a string of a number and a unit: ``kB``, ``MB``, ``GB``, ``TB`` (powers of 1000),
``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024), case-insensitive, or none (bytes): ``5000000``, ``"500MB"``,
``"1.5 GiB"``. Anything else, or a size below zero (or zero where zero is not allowed), raises ValueError in one line
that names the option.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, name: str = "max_bytes", zero: bool = False) -> int:
    """A size in bytes from ``5000000``, ``"5GB"`` or ``"1.5 GiB"`` (see the module's contract); ``zero``: 0 is
    allowed (it turns a bound's store or tier off). ``name`` is the option named in the error.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name} must be a size such as 5000000, '500MB' or '5GiB', got {text!r}")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 0 or (size == 0 and not zero):
        raise ValueError(f"{name} must be {'>= 0' if zero else 'positive'}, got {text!r}")
    return size
