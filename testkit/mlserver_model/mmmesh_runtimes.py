"""Tiny MLServer custom runtimes for tests/sidecar/test_kserve.py (run by MLServer in
.venv-mlserver, not by the project's venv).

``Double``: every input tensor comes back as ``output`` = input * 2, same
datatype and shape (any numeric datatype, any shape); an input named
``boom`` makes it raise (to test how server errors reach the client).  ``Sleepy``: the same
after sleeping ``parameters.extra.sleep_s`` seconds (to test client timeouts).
"""

from __future__ import annotations

import asyncio

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput


class Double(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        outputs = []
        for inp in payload.inputs:
            if inp.name == "boom":
                raise MLServerError("boom: this model was asked to fail", status_code=400)
            arr = NumpyCodec.decode_input(inp)
            out = arr * 2
            enc = NumpyCodec.encode_output("output", out)
            # keep the request's shape (the codec adds a batch dim to 1-D)
            outputs.append(ResponseOutput(name="output", datatype=enc.datatype,
                                          shape=list(out.shape), data=enc.data))
        return InferenceResponse(model_name=self.name, model_version=self.version,
                                 id=payload.id, outputs=outputs)


class Sleepy(Double):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        extra = (self.settings.parameters.extra if self.settings.parameters else None) or {}
        await asyncio.sleep(float(extra.get("sleep_s", 2.0)))
        return await super().predict(payload)
