"""Runners that send each stage input to a KServe v2 / Open Inference Protocol
server (Triton, KServe's Python model server, MLServer, OpenVINO Model
Server, ...) and forward its output tensor.

    runner: {kind: kserve-rest, target: "http://127.0.0.1:8080", model_name: resnet,
             input_name: input, output_name: logits, timeout_s: 2, binary_data: true}
    runner: {kind: kserve-grpc, target: "127.0.0.1:8081", model_name: resnet}

The protocol is spoken by tritonclient's asyncio clients (``tritonclient.http.aio``
and ``tritonclient.grpc.aio``), which implement exactly the v2 REST and gRPC
APIs.  REST sends and asks for tensors with the binary tensor data extension
(``binary_data_size`` parameters after an ``Inference-Header-Content-Length``
JSON header) when ``binary_data`` is true, plain JSON otherwise; a server without
the extension (MLServer 1.7's REST endpoint) needs ``binary_data: false``.  gRPC
always uses ``raw_input_contents``.

start() waits up to ``timeout_s`` for the server to be live and the model to be
ready, and raises KServeError naming the URL and the model when they are not.
Each infer() is bounded by ``timeout_s``; running past it raises KServeTimeout
(a KServeError and a TimeoutError).  Errors the server reports (HTTP 4xx/5xx,
a gRPC status) raise KServeError carrying the server's message.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import numpy as np
import tritonclient.grpc as grpcclient  # type: ignore[import-untyped]
import tritonclient.grpc.aio as grpcaio  # type: ignore[import-untyped]
import tritonclient.http as httpclient  # type: ignore[import-untyped]
import tritonclient.http.aio as httpaio  # type: ignore[import-untyped]
from tritonclient.utils import InferenceServerException  # type: ignore[import-untyped]

from mmmesh.errors import MeshError
from sidecar.config import RunnerConfig
from sidecar.contract import KSERVE_NAMES, NUMPY_TO_DTYPE, StageInput

__all__ = ["KServeError", "KServeGrpcRunner", "KServeRestRunner", "KServeTimeout",
           "kserve_datatype"]

_POLL_S = 0.1


class KServeError(MeshError):
    """A KServe v2 server could not be reached, refused a request or failed it.
    ``status`` is the HTTP status ("404") or gRPC code ("StatusCode.NOT_FOUND")
    when the server answered, else None."""

    def __init__(self, message: str, *, url: str = "", model: str = "",
                 status: str | None = None) -> None:
        self.url = url
        self.model = model
        self.status = status
        super().__init__(message)


class KServeTimeout(KServeError, TimeoutError):
    """No answer within the runner's timeout_s."""


def kserve_datatype(array: np.ndarray) -> str:
    """The v2 protocol datatype name ("FP32", "INT64", ...) of a numpy array."""
    dt = array.dtype
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    code = NUMPY_TO_DTYPE.get(dt)
    if code is None:
        raise KServeError(f"dtype {array.dtype} has no KServe v2 datatype")
    return KSERVE_NAMES[code]


def _wire_array(array: np.ndarray) -> np.ndarray:
    """C-ordered, little-endian: what both protocols' raw encodings expect."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array)


def _split_target(target: str, schemes: dict[str, bool]) -> tuple[str, bool]:
    """("host:port[/prefix]", ssl) from a target with an optional scheme."""
    t = target.strip()
    for scheme, ssl in schemes.items():
        if t.lower().startswith(scheme):
            t = t[len(scheme):]
            return t.rstrip("/"), ssl
    if "://" in t:
        raise KServeError(f"unsupported scheme in KServe target {target!r} "
                          f"(use {', '.join(schemes)} or host:port)", url=target)
    return t.rstrip("/"), False


class _Base:
    kind = "kserve"
    url = ""

    def __init__(self, cfg: RunnerConfig) -> None:
        if not cfg.model_name:
            raise KServeError(f"{self.kind} runner needs model_name (target {cfg.target})",
                              url=cfg.target)
        self.cfg = cfg
        self.model = cfg.model_name
        self.version = cfg.model_version or ""
        self.timeout_s = float(cfg.timeout_s)
        self.output_name: str | None = cfg.output_name
        self.name = f"{self.kind}:{self.model}"
        self._client: Any = None

    # what the error messages call the model: 'name' or 'name' version 3
    @property
    def _what(self) -> str:
        return f"model {self.model!r}" + (f" version {self.version}" if self.version else "")

    def _err(self, msg: str, status: str | None = None,
             cls: type[KServeError] = KServeError) -> KServeError:
        return cls(f"{self.kind} {self.url}: {self._what}: {msg}", url=self.url,
                   model=self.model, status=status)

    async def _probe(self) -> str | None:
        """None when the server is live and the model ready, else what is
        wrong.  Raises when the server cannot be reached."""
        raise NotImplementedError

    async def _model_list(self) -> list[str]:
        return []

    async def _metadata(self) -> dict[str, Any]:
        """The model's metadata (v2 protocol, as JSON)."""
        raise NotImplementedError

    async def _first_output(self) -> str | None:
        """The name of the model's first declared output (None: it declares none)."""
        outs = (await self._metadata()).get("outputs") or []
        return str(outs[0]["name"]) if outs else None

    def _started(self) -> Any:
        """The client; KServeError when the runner is not started."""
        if self._client is None:
            raise self._err("runner is not started")
        return self._client

    def _connect(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        if self._client is None:
            self._connect()
        deadline = time.monotonic() + self.timeout_s
        problem: str | None = "no answer"
        while True:
            left = deadline - time.monotonic()
            try:
                problem = await asyncio.wait_for(self._probe(), max(left, _POLL_S))
                if problem is None:
                    break
            except TimeoutError:
                problem = f"no answer within {self.timeout_s:g}s"
            except Exception as e:  # unreachable, refused, TLS, ...
                problem = f"server unreachable: {_describe(e)}"
            if time.monotonic() + _POLL_S >= deadline:
                if problem.startswith("model is not ready"):
                    models = await self._safe_model_list()
                    if models:
                        problem += f" (the server has: {', '.join(models)})"
                await self.close()
                raise self._err(f"{problem} (waited {self.timeout_s:g}s)")
            await asyncio.sleep(_POLL_S)
        if self.output_name is None:
            try:
                self.output_name = await asyncio.wait_for(self._first_output(),
                                                          self.timeout_s)
            except Exception:
                self.output_name = None  # fall back to the response's first output

    async def _safe_model_list(self) -> list[str]:
        try:
            return await asyncio.wait_for(self._model_list(), self.timeout_s)
        except Exception:
            return []

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception:
                pass


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0] if text.strip() else type(e).__name__


class KServeRestRunner(_Base):
    """KServe v2 REST (HTTP/JSON, binary tensor extension when cfg.binary_data)."""

    kind = "kserve-rest"

    def __init__(self, cfg: RunnerConfig) -> None:
        super().__init__(cfg)
        self._hostport, self._ssl = _split_target(cfg.target, {"http://": False,
                                                               "https://": True})
        self.url = ("https://" if self._ssl else "http://") + self._hostport
        self.binary = bool(cfg.binary_data)
        self._headers = {"Content-Type": "application/octet-stream" if self.binary
                         else "application/json"}

    def _connect(self) -> None:
        self._client = httpaio.InferenceServerClient(
            self._hostport, conn_limit=max(1, self.cfg.concurrency),
            conn_timeout=self.timeout_s, ssl=self._ssl)

    async def _probe(self) -> str | None:
        if not await self._client.is_server_live():
            return "server is not live"
        if not await self._client.is_model_ready(self.model, self.version):
            return "model is not ready"
        return None

    async def _model_list(self) -> list[str]:
        index = await self._client.get_model_repository_index()
        return sorted({str(m.get("name")) for m in index if m.get("name")})

    async def _metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = await self._client.get_model_metadata(self.model, self.version)
        return meta

    async def infer(self, inp: StageInput) -> np.ndarray:
        client = self._started()
        arr = _wire_array(inp.array)
        try:
            tensor = httpclient.InferInput(self.cfg.input_name, list(arr.shape),
                                           kserve_datatype(arr))
            tensor.set_data_from_numpy(arr, binary_data=self.binary)
            outputs = None
            if self.output_name is not None:
                outputs = [httpclient.InferRequestedOutput(self.output_name,
                                                           binary_data=self.binary)]
        except InferenceServerException as e:  # e.g. FP16 has no JSON encoding
            raise self._err(f"cannot encode input {self.cfg.input_name!r}: "
                            f"{e.message()}") from None
        try:
            async with asyncio.timeout(self.timeout_s):
                for attempt in (1, 2):
                    try:
                        result = await client.infer(self.model, [tensor],
                                                    model_version=self.version,
                                                    outputs=outputs, headers=self._headers)
                        break
                    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                        # a kept-alive connection the server had closed (MLServer
                        # closes it after a 500): send once more on a new one
                        if attempt == 2:
                            raise
        except TimeoutError:
            raise self._err(f"no answer within {self.timeout_s:g}s",
                            cls=KServeTimeout) from None
        except InferenceServerException as e:
            raise self._server_error(e) from None
        except Exception as e:  # aiohttp: connection refused / reset ...
            raise self._err(f"request failed: {_describe(e)}") from None
        return self._output(result.get_response(), result.as_numpy)

    def _server_error(self, e: Any) -> KServeError:
        status = e.status()
        msg = e.message() or "(no message)"
        if msg.startswith("an exception occurred in the client while decoding"):
            body = (e.debug_details() or "").strip()
            msg = f"non-JSON error body: {body[:300]!r}" if body else "empty error body"
            if self.binary:
                msg += (" (if this server lacks the binary tensor data extension, "
                        "set binary_data: false)")
        return self._err(f"server error {status}: {msg}", status=status)

    def _output(self, response: dict[str, Any], as_numpy: Any) -> np.ndarray:
        outs = response.get("outputs") or []
        name = self.output_name
        if name is None:
            if not outs:
                raise self._err("response has no outputs")
            name = str(outs[0]["name"])
        out = as_numpy(name)
        if out is None:
            have = ", ".join(str(o.get("name")) for o in outs) or "none"
            raise self._err(f"response has no output {name!r} (outputs: {have})")
        return _check_output(self, name, out)


def _check_output(r: _Base, name: str, out: np.ndarray) -> np.ndarray:
    if out.dtype == np.object_ or out.dtype.kind in "SU":
        raise r._err(f"output {name!r} is BYTES, which a tensor frame cannot carry")
    return out


class KServeGrpcRunner(_Base):
    """KServe v2 gRPC (inference.GRPCInferenceService, raw_input_contents)."""

    kind = "kserve-grpc"

    def __init__(self, cfg: RunnerConfig) -> None:
        super().__init__(cfg)
        self._hostport, self._ssl = _split_target(
            cfg.target, {"grpc://": False, "http://": False, "grpcs://": True,
                         "https://": True})
        self.url = ("grpcs://" if self._ssl else "grpc://") + self._hostport

    def _connect(self) -> None:
        self._client = grpcaio.InferenceServerClient(self._hostport, ssl=self._ssl)

    async def _probe(self) -> str | None:
        t = max(self.timeout_s, _POLL_S)
        if not await self._client.is_server_live(client_timeout=t):
            return "server is not live"
        try:
            ready = await self._client.is_model_ready(self.model, self.version,
                                                      client_timeout=t)
        except InferenceServerException as e:  # MLServer: an error for unknown models
            return f"model is not ready: {e.message() or e.status()}"
        return None if ready else "model is not ready"

    async def _model_list(self) -> list[str]:
        index = await self._client.get_model_repository_index(as_json=True)
        return sorted({str(m.get("name")) for m in index.get("models", []) if m.get("name")})

    async def _metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = await self._client.get_model_metadata(
            self.model, self.version, as_json=True, client_timeout=self.timeout_s)
        return meta

    async def infer(self, inp: StageInput) -> np.ndarray:
        client = self._started()
        arr = _wire_array(inp.array)
        tensor = grpcclient.InferInput(self.cfg.input_name, list(arr.shape),
                                       kserve_datatype(arr))
        tensor.set_data_from_numpy(arr)  # -> raw_input_contents
        outputs = None
        if self.output_name is not None:
            outputs = [grpcclient.InferRequestedOutput(self.output_name)]
        try:
            # the gRPC deadline is the real bound; the asyncio one is a backstop
            async with asyncio.timeout(self.timeout_s + 0.5):
                result = await client.infer(self.model, [tensor], model_version=self.version,
                                            outputs=outputs, client_timeout=self.timeout_s)
        except TimeoutError:
            raise self._err(f"no answer within {self.timeout_s:g}s",
                            cls=KServeTimeout) from None
        except InferenceServerException as e:
            status = e.status()
            if status == "StatusCode.DEADLINE_EXCEEDED":
                raise self._err(f"no answer within {self.timeout_s:g}s", status=status,
                                cls=KServeTimeout) from None
            raise self._err(f"server error {status}: {e.message() or '(no message)'}",
                            status=status) from None
        except Exception as e:
            raise self._err(f"request failed: {_describe(e)}") from None
        response = result.get_response()
        name = self.output_name
        if name is None:
            if not response.outputs:
                raise self._err("response has no outputs")
            name = response.outputs[0].name
        out = result.as_numpy(name)
        if out is None:
            have = ", ".join(o.name for o in response.outputs) or "none"
            raise self._err(f"response has no output {name!r} (outputs: {have})")
        return _check_output(self, name, out)
