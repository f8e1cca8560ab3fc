"""Argument types shared by the demo's command lines (demo/cli.py and the
pipeline's, demo/pipeline/cli.py)."""

from __future__ import annotations

import argparse

from mmmesh.policy import Rate

__all__ = ["rate", "seconds"]


def rate(text: str) -> int:
    try:
        return int(Rate(text))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.5 <= v <= 600:
        raise argparse.ArgumentTypeError("duration must be between 0.5 and 600 seconds")
    return v
