"""``python -m mmmesh.cli``: the same as the ``mmmesh`` console script."""

import sys

from . import main

sys.exit(main())
