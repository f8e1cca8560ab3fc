"""``python -m mmmesh.ctl``: the same as the ``mmmeshctl`` console script."""

from . import main

main()
