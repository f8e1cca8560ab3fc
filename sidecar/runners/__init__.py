"""Model stages behind the sidecar.  ``make_runner(cfg)`` picks one by ``cfg.kind``:

==============  ====================================================  ==========================
kind            target                                                class
==============  ====================================================  ==========================
python          ``package.module:function`` (ndarray -> ndarray|None)  local.PythonRunner
onnx            path of an ``.onnx`` model file                       local.OnnxRunner
kserve-rest     ``http://host:port`` of a KServe v2 server            kserve.KServeRestRunner
kserve-grpc     ``host:port`` of a KServe v2 gRPC server              kserve.KServeGrpcRunner
==============  ====================================================  ==========================

The KServe runners are imported only when used (they pull in HTTP/gRPC clients).
"""

from __future__ import annotations

from ..config import RunnerConfig
from ..contract import Runner

__all__ = ["make_runner"]


def make_runner(cfg: RunnerConfig) -> Runner:
    """A (not yet started) Runner for ``cfg``."""
    if cfg.kind == "python":
        from .local import PythonRunner

        return PythonRunner(cfg)
    if cfg.kind == "onnx":
        from .local import OnnxRunner

        return OnnxRunner(cfg)
    if cfg.kind == "kserve-rest":
        from .kserve import KServeRestRunner

        return KServeRestRunner(cfg)
    if cfg.kind == "kserve-grpc":
        from .kserve import KServeGrpcRunner

        return KServeGrpcRunner(cfg)
    raise ValueError(f"unknown runner kind {cfg.kind!r}")
