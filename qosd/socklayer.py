"""The socket layer in qosd (docs/socklayer.md, "qosd"): ``SocketLayer`` on
the cgroup of ``socket_layer.cgroup``, brought up (loaded, or adopted when
the same build is pinned) at start and checked at every resync, its
endpoints and redirect switch from qosd.yaml, its replica weights written
by the SLA controller (qosd/controller/host.py).

Like the TC side, it stays when qosd stops (the next qosd adopts it: same
program ids, same sockets) and ``qosd --cleanup`` removes it.  Stage
identity comes from the configuration: ``socket_layer.stages`` names each
stage as its sidecars report it, gives the socket layer's number for it, its
replicas' endpoints (and which reporter speaks for each), and its pods'
source prefixes; the socket layer's registry only says which configured
endpoint a connection reached.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from mmmesh.abi import Modality
from mmmesh.dataplane import Endpoint, SocketLayer, SocketUpResult
from mmmesh.errors import MeshError

from .config import SocketLayerConfig

log = logging.getLogger("qosd.socklayer")


def modality_name(m: int) -> str:
    try:
        return Modality(m).name.lower()
    except ValueError:
        return str(m)


class SocketLayerHost:
    """The socket layer of one qosd (nothing happens when it is disabled)."""

    def __init__(self, cfg: SocketLayerConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._layer: SocketLayer | None = None
        self.result: SocketUpResult | None = None
        self.error: str | None = None
        self.counts: Counter[str] = Counter()  # up_ok, up_error, reattached, weights_*

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def layer(self) -> SocketLayer:
        if self._layer is None:
            self._layer = SocketLayer(self.cfg.cgroup)
        return self._layer

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(e.address, e.port, st.id, e.replica)
                for st in self.cfg.stages for e in st.endpoints]

    # ------------------------------------------------------------ write
    def start(self) -> SocketUpResult | None:
        """Loads or adopts the layer and applies the configuration (endpoints,
        switches); errors are kept for status and retried by :meth:`ensure`.
        Disabled: a layer still pinned on the cgroup (from a run with it
        enabled) is taken down."""
        if not self.enabled:
            self._off()
            return None
        with self._lock:
            try:
                res = self.layer().up(self.endpoints(), redirect=self.cfg.redirect,
                                      all_sockets=self.cfg.all_sockets)
                self._prune_weights()
            except MeshError as e:
                self.error = str(e)
                self.counts["up_error"] += 1
                log.error("socket layer on cgroup %r: %s (retried at every resync)",
                          self.cfg.cgroup or "/", e)
                return None
            self.result, self.error = res, None
            self.counts["up_ok"] += 1
            log.info("socket layer %s on %s (programs %s)",
                     "adopted" if res.adopted else "loaded", res.cgroup,
                     ", ".join(f"{k} {v}" for k, v in sorted(res.prog_ids.items())))
            return res

    def _prune_weights(self) -> None:
        """Weights an adopted layer holds for a stage that is no longer weighted
        (left out of qosd.yaml, or down to one replica) go: the SLA controller
        writes only its weighted stages, so they would steer frames for good."""
        keep = {st.id for st in self.cfg.stages if len({e.replica for e in st.endpoints}) >= 2}
        for sid in sorted(set(self.layer().weights()) - keep):
            self.layer().set_weights(sid, [])
            log.info("socket layer: removed the weights of stage %d (not weighted in "
                     "qosd.yaml socket_layer.stages)", sid)

    def _off(self) -> None:
        try:
            if self.down():
                log.warning("socket_layer.enabled is false: took down the socket layer "
                            "pinned on cgroup %r", self.cfg.cgroup or "/")
        except MeshError as e:  # no cgroup v2, a foreign pin: leave it, say so
            log.debug("socket layer (disabled): %s", e)

    def ensure(self) -> None:
        """At every resync: up again when it failed before, is unpinned, or a
        program was detached (the repair is logged and counted)."""
        if not self.enabled:
            return
        if self.result is None:
            self.start()
            return
        try:
            st = self.layer().status()
        except MeshError as e:
            st = None
            log.warning("socket layer status: %s", e)
        if st is not None and st.loaded and all(st.attached.values()) and st.attached:
            return
        log.warning("socket layer on %s: %s; bringing it up again", self.layer().cgroup,
                    "not pinned" if st is None or not st.loaded else "a program was detached")
        self.counts["reattached"] += 1
        self.start()

    def weights(self) -> dict[int, tuple[int, ...]]:
        """The weights the kernel holds, by stage number ({} when not up)."""
        if not self.enabled or self.result is None:
            return {}
        return self.layer().weights()

    def set_weights(self, stage: int, weights: list[int]) -> bool:
        """Writes ``stage``'s weights when the kernel holds others (True);
        MeshError (counted) when the write fails."""
        have = self.weights().get(stage)
        want = tuple(weights) + (0,) * (len(have or ()) - len(weights))
        if have == want or (have is None and not any(weights)):
            return False
        try:
            self.layer().set_weights(stage, weights)
        except MeshError:
            self.counts["weights_error"] += 1
            raise
        self.counts["weights_written"] += 1
        return True

    def down(self) -> bool:
        """Detaches and unpins (``qosd --cleanup``); True if it was pinned."""
        layer = self.layer()
        if not layer.loaded():
            return False
        layer.down()
        return True

    # ------------------------------------------------------------- read
    def status(self) -> dict[str, Any]:
        """``GET /v1/status``'s ``socket_layer``."""
        out: dict[str, Any] = {"enabled": self.enabled, "cgroup": self.cfg.cgroup or "/",
                               "stages": {st.name: st.id for st in self.cfg.stages}}
        if not self.enabled:
            return out
        out.update(error=self.error, adopted=self.result.adopted if self.result else None)
        try:
            st = self.layer().status()
        except MeshError as e:
            out["error"] = str(e)
            return out
        out.update(cgroup=st.cgroup, pin_dir=st.pin_dir, loaded=st.loaded,
                   attached=st.attached, prog_ids=st.prog_ids, register=st.register,
                   redirect=st.redirect, all_sockets=st.all_sockets, endpoints=st.endpoints,
                   flows=st.flows, weights={str(k): list(v) for k, v in st.weights.items()})
        if st.stats is not None:
            out["events"] = {k: v for k, v in st.stats.events.items() if v}
            out["modalities"] = {modality_name(m): {"frames": f, "bytes": b}
                                 for m, (f, b) in st.stats.modalities.items()}
        return out
