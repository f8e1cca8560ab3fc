"""Development-only harnesses shared by tests/ and bench/ (not installed):
netns meshes, an etcd cluster, a real qosd on a node, the socket-layer kit,
hostile clients, Prometheus, the shared cases of the tests.  Nothing under
mmmesh/, qosd/, sidecar/, mmmeshctl/ or demo/ imports it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The checkout."""
