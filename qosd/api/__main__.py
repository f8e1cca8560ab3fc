"""``python -m qosd.api --openapi FILE``: see qosd/api/openapi.py."""

from __future__ import annotations

from .openapi import main

raise SystemExit(main())
