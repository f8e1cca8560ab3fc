"""The multi-node QoS demo: network-namespace nodes, real traffic, mesh off vs on.

    testbed.py   nodes (netns) joined by veth links, the sender's uplink shaped
    netlab.py    netlink for testbeds: namespaces, veth links, routes, the FIFO baseline
    streams.py   ports, the traffic spec, MMH frame templates, latency statistics
    traffic.py   voice / video flood / LiDAR senders and receivers, one process each
    voice.py     the voice sender (TX timestamps) and where a voice frame waits
    scenario.py  the phases (mesh off, mesh on, unloaded) and their results
    report.py    progress lines, the table, results.json and latency.png
    pipeline.py  the reference multimodal pipeline across three namespace nodes
    pipeline_procs.py  its child processes (sidecars, sensors, collector, flood)
    pipeline_mesh.py   a qosd per node, joined as a mesh (mTLS), the global SLA view
    pipeline_cli.py  ``mmmesh-demo --pipeline``: arguments and the table
    closed_loop.py   ``mmmesh-demo --closed-loop``: the SLA controller off vs on
    closed_loop_flood.py    its video flood (UDP segmentation offload), reported to qosd
    closed_loop_observe.py  what it watches: stage windows, HTB classes, the controller
    closed_loop_report.py   its figures (settle, oscillations, max step, back to the policy)
    closed_loop_show.py     its table and plot
    closed_loop_cli.py      its arguments and output
    _cli.py      ``mmmesh-demo``

Everything here needs root; nothing outside the namespaces the testbed
creates is touched, and they are removed on exit, failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
"""The checkout's examples/: the policies and the pipeline's sidecar configs
the demo runs with.  The demo runs from a checkout of mmmesh (an editable
install, as ``scripts/demo.sh`` makes): docs/architecture.md, "Decisions"."""
