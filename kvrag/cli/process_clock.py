"""How long this process has run: the seconds since the operating system started it, for ``kvrag ask --timings``.

Contract: `seconds_since_start()` reads the process's start from ``/proc/self/stat`` (in clock ticks since boot)
against ``/proc/uptime``, at the kernel's tick resolution (10 ms on most systems); None where ``/proc`` is absent
(not Linux) or unreadable. It imports nothing beyond the standard library.
"""

from __future__ import annotations

import os


def seconds_since_start() -> float | None:
    """Seconds since this process started, or None where the system does not say."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return max(up - int(fields[19]) / ticks, 0.0)  # field 22 of the whole line: starttime
    except (OSError, ValueError, IndexError):
        return None
