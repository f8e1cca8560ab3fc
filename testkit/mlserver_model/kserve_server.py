"""KServe's own Python model server (kserve.ModelServer) serving "double"
(output = input * 2, same datatype and shape; an input named ``boom`` fails),
for tests/sidecar/test_kserve.py.

MLServer's REST endpoint does not implement the binary tensor data extension;
KServe's does, so the REST binary tests run against this server.  Run by
.venv-mlserver's python:  python kserve_server.py --http_port N --grpc_port M

kserve binds 0.0.0.0 / [::]; this test server is pinned to 127.0.0.1.
"""

from __future__ import annotations

import uvicorn
from grpc.aio import _server as _grpc_aio_server
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve.errors import InvalidInput


class _LoopbackConfig(uvicorn.Config):
    def __init__(self, *a, **kw):  # type: ignore[no-untyped-def]
        kw["host"] = "127.0.0.1"
        super().__init__(*a, **kw)


_orig_add_port = _grpc_aio_server.Server.add_insecure_port


def _loopback_port(self, address: str) -> int:  # type: ignore[no-untyped-def]
    return _orig_add_port(self, address.replace("[::]", "127.0.0.1"))


class Double(Model):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None,  # type: ignore[no-untyped-def]
                      response_headers=None) -> InferResponse:
        outputs = []
        for inp in payload.inputs:
            if inp.name == "boom":
                raise InvalidInput("boom: this model was asked to fail")
            arr = inp.as_numpy() * 2
            out = InferOutput(name="output", shape=list(arr.shape), datatype=inp.datatype)
            out.set_data_from_numpy(arr, binary_data=False)
            outputs.append(out)
        return InferResponse(response_id=payload.id or "", model_name=self.name,
                             infer_outputs=outputs, from_grpc=payload.from_grpc,
                             use_binary_outputs=payload.use_binary_outputs,
                             requested_outputs=payload.request_outputs)


if __name__ == "__main__":
    # looked up when the servers start, so patching after the imports is enough
    uvicorn.Config = _LoopbackConfig  # type: ignore[misc]
    _grpc_aio_server.Server.add_insecure_port = _loopback_port  # type: ignore[method-assign]
    ModelServer(enable_latency_logging=False).start([Double("double")])
