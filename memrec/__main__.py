"""``python -m memrec``: the memrec command."""

from __future__ import annotations

import sys

from memrec.commands import main

if __name__ == "__main__":
    sys.exit(main())
