"""The multi-node QoS demo: network-namespace nodes, real traffic, mesh off vs on.

    testbed.py   nodes (netns) joined by veth links, the sender's uplink shaped
    traffic.py   voice / video flood / LiDAR senders and receivers, one process each
    scenario.py  the phases (mesh off, mesh on, unloaded) and their results
    report.py    progress lines, the table, results.json and latency.png
    _cli.py      ``mmmesh demo``

Everything here needs root; nothing outside the namespaces the testbed
creates is touched, and they are removed on exit, failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations
