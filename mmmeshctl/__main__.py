"""``python -m mmmeshctl``: the same as the ``mmmeshctl`` console script."""

from . import main

main()
