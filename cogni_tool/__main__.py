"""``python -m cogni_tool``: the same as the ``cogni-tool`` command."""

from __future__ import annotations

import sys

from cogni_tool.cli import main

if __name__ == "__main__":
    sys.exit(main())
