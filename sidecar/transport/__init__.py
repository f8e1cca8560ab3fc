"""MMH frames in and out of a sidecar: the public face of three modules.

=============  ==============================================================
module         role
=============  ==============================================================
``receive``    ``FrameServer``: frames over TCP (and UDP) into the inbound
               queue; TCP flow control as backpressure; hostile peers cut off
``send``       ``FrameSender`` (one per Output): the lane of each frame,
               real-time drops, UDP
``lane``       ``Lane``: one connection per downstream replica: zero-copy
               ``sendmsg``, batching, reconnects, frames moved whole off a
               lane that is down
``spread``     ``Swrr``: the socket layer's weighted pick, in user space
``frames``     ``InFrame``, ``FrameQueue`` (bounded in frames and in bytes)
               and the send side's frame bookkeeping
=============  ==============================================================

The deadline rule both sides of a sidecar apply is ``contract.drop_late``.
"""

from .frames import FrameQueue, InFrame, inframe_queue
from .receive import FrameServer, ServerCounters
from .send import FrameSender, SenderCounters

__all__ = [
    "FrameQueue",
    "FrameSender",
    "FrameServer",
    "InFrame",
    "SenderCounters",
    "ServerCounters",
    "inframe_queue",
]
