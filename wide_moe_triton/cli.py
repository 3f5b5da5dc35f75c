"""What the package's two commands, ``wide-moe`` and ``wide-moe-tune``, share."""

from __future__ import annotations

import os
import sys


def invoked_name(module: str) -> str:
    """The command's name as the user typed it: the installed script's (``wide-moe``), or
    ``python -m module`` when run as a module (``sys.argv[0]`` is then the file's path)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return f"python -m {module}" if name in ("", "-c") or name.endswith(".py") else name
