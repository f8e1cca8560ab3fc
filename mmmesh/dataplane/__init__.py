"""The BPF dataplane: the only way into the kernel.

The public face is small::

    from mmmesh.dataplane import Dataplane

    dp = Dataplane("eth0")                 # a device (and netns=...)
    dp.up(policy, version=3)               # load or adopt, write maps, reconcile HTB
    dp.status(policy)                      # DataplaneStatus: programs, classes, counters
    dp.drift(policy, 3)                    # [] or what differs from what up() leaves
    dp.stats()                             # DataplaneStats: counters + flow census (metrics)
    dp.flows()                             # [Flow]: the TCP flow table, decoded
    dp.htb_classes()                       # {classid: HtbClassStats}
    dp.set_overrides(Overrides(stages=(StageOverride("voice", "10.1.0.7/32", Boost(weight=8)),)),
                     effective, bounds=policy)  # boost leaves, override maps (docs/dataplane.md)
    dp.overrides(policy)                   # [OverrideEntry]: what the kernel holds, hits
    dp.down()                              # detach, unpin, restore the device

    dp = Dataplane("eth0", egress="auto")  # egress mode: "htb" (default), "fq" or "auto"
    dp.egress_mode()                       # "fq" on a multiqueue NIC with sch_fq bands, else "htb"
    dp.check(policy)                       # [(field, message)] the mode cannot realise
    dp.fq_qdiscs(); dp.pacers()            # egress mode fq: each queue's fq, each pacer
    dp.realisable(overrides, effective)    # (overrides the mode can realise, why the others not)

The socket layer (sockops + SOCKHASH + sk_msg on a cgroup v2, docs/socklayer.md)
has a handle of its own::

    sl = SocketLayer("mesh.slice")         # a cgroup below the cgroup v2 mount
    sl.up([Endpoint("10.1.0.7", 7000, stage=2)])   # load or adopt, attach
    sl.set_weights(2, [3, 1]); sl.set_redirect(False); sl.flows(); sl.down()

Results are typed values (``_types.py``, ``_socklayer.py``), errors are
``DataplaneError``.  Overrides (``mmmesh.policy.overrides``: ``Boost``, ``StageOverride``,
``FlowOverride``, ``Overrides``, ``OverrideEntry``) send a stage's or a flow's
frames into a boost leaf of their class.
Heavy imports (bcc, pyroute2) happen only in the calls that need them; bcc
only ever in a short-lived child process (``_bcc.py``).  Private modules:
``_pins`` (bpffs, adoption, staging), ``_maps`` (typed maps), ``_bpf`` (libbpf
via ctypes), ``_netlink`` (pyroute2: clsact, filters, HTB), ``_compile``
(policy -> map entries + HTB spec), ``_bcc`` (compile and load), ``_sock``
(the socket layer's cgroup, pins, attachment and maps), ``_egress`` (the
egress modes' rule and fq drift), and ``classify``
(test runs of the real program, for the CLI and the tests).  They import one
another (``from . import _bpf``, ``from ._maps import Maps``), never this
face, which imports them.
"""

from mmmesh.policy.overrides import Boost, FlowOverride, OverrideEntry, Overrides, StageOverride

from ._bcc import build_id
from ._egress import EGRESS_CHOICES, choose_egress
from ._handle import Dataplane, link_exists
from ._pins import PIN_ROOT, ensure_bpffs
from ._socklayer import (
    Endpoint,
    SocketFlow,
    SocketLayer,
    SocketState,
    SocketStats,
    SocketStatus,
    SocketUpResult,
)
from ._types import (
    ClassStatus,
    DataplaneStats,
    DataplaneStatus,
    DirectionCounters,
    Flow,
    FlowCensus,
    FqQdiscStats,
    HtbClassStats,
    PacerState,
    UpResult,
    handle,
)

__all__ = [
    "EGRESS_CHOICES",
    "PIN_ROOT",
    "Boost",
    "ClassStatus",
    "Dataplane",
    "DataplaneStats",
    "DataplaneStatus",
    "DirectionCounters",
    "Endpoint",
    "Flow",
    "FlowCensus",
    "FlowOverride",
    "FqQdiscStats",
    "HtbClassStats",
    "OverrideEntry",
    "Overrides",
    "PacerState",
    "SocketFlow",
    "SocketLayer",
    "SocketState",
    "SocketStats",
    "SocketStatus",
    "SocketUpResult",
    "StageOverride",
    "UpResult",
    "build_id",
    "choose_egress",
    "ensure_bpffs",
    "handle",
    "link_exists",
]
