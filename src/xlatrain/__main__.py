"""``python -m xlatrain``: the ``xlatrain`` command."""

import sys

from xlatrain.cli import main

sys.exit(main())
