"""`python -m gatewayd.cli`: the `gatewayd` console script."""

import sys

from gatewayd.cli import main

sys.exit(main())
