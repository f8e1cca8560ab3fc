"""In-process runners: a Python function, or an ONNX model with onnxruntime.

Synchronous work runs in a thread pool of ``cfg.concurrency`` threads so the
event loop keeps moving frames.  A synchronous function cannot be cancelled:
when it overruns ``timeout_s`` the sidecar sends STAGE_TIMEOUT and moves on,
but the thread stays busy until the call returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..config import RunnerConfig
from ..contract import BatchResult, BatchRunner, StageInput

__all__ = ["OnnxRunner", "PythonRunner", "load_target"]

log = logging.getLogger("mmmesh.sidecar.runners")


def load_target(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` (or ``module:Class.method``) -> the callable."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"python runner target must be 'package.module:function', got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is not callable")
    return obj  # type: ignore[no-any-return]


class PythonRunner(BatchRunner):
    """Calls ``function(array)`` — or ``function(array, header=...)`` when the
    function takes a ``header`` parameter (stateful stages such as a fusion
    stage need the stream id and sequence); a coroutine function is awaited on
    the loop, a plain one runs in the runner's thread pool.  A plain function
    also takes batches (``contract.BatchRunner``): the frames already waiting
    run in one thread hop."""

    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        self.name = cfg.target
        self._fn: Callable[..., Any] | None = None
        self._async = False
        self._wants_header = False
        self._pool: ThreadPoolExecutor | None = None
        self.abandoned_threads = 0  # hung sync calls given up on (their threads leak)

    async def start(self) -> None:
        self._fn = load_target(self.cfg.target)
        self._async = inspect.iscoroutinefunction(self._fn)
        try:
            self._wants_header = "header" in inspect.signature(self._fn).parameters
        except (TypeError, ValueError):  # builtins without a signature
            self._wants_header = False
        if not self._async:
            self._pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency,
                                            thread_name_prefix="stage")

    async def infer(self, inp: StageInput) -> np.ndarray | None:
        fn = self._fn
        if fn is None:
            raise RuntimeError("runner not started")
        if self._wants_header:
            fn = functools.partial(fn, header=inp.header)
        if self._async:
            result = await fn(inp.array)
        else:
            assert self._pool is not None
            cf = self._pool.submit(fn, inp.array)
            try:
                result = await asyncio.wrap_future(cf)
            except asyncio.CancelledError:
                self._abandon_if_running(cf)
                raise
            if inspect.isawaitable(result):
                result = await result
        return None if result is None else np.asarray(result)

    @property
    def batchable(self) -> bool:
        """Plain functions: the stage may hand over queued frames in one hop."""
        return self._fn is not None and not self._async

    async def infer_batch(self, inputs: Sequence[StageInput], done: list[BatchResult]) -> None:
        """Runs ``inputs`` in order in ONE thread hop, appending
        (ok, result-or-exception, end ns) to ``done`` as each finishes, so a
        caller that gives up (timeout) keeps what was finished; the inputs not
        started by then are never started."""
        fn = self._fn
        if fn is None or self._async:
            raise RuntimeError("infer_batch needs a started plain-function runner")
        wants_header = self._wants_header
        stop = threading.Event()

        def run_all() -> None:
            for inp in inputs:
                if stop.is_set():
                    return
                try:
                    r = fn(inp.array, header=inp.header) if wants_header else fn(inp.array)
                    done.append(BatchResult(True, None if r is None else np.asarray(r),
                                            time.time_ns()))
                except Exception as e:  # per input, like infer()
                    done.append(BatchResult(False, e, time.time_ns()))

        assert self._pool is not None
        cf = self._pool.submit(run_all)
        try:
            await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            stop.set()
            self._abandon_if_running(cf)
            raise

    def _abandon_if_running(self, cf: concurrent.futures.Future[Any]) -> None:
        """The stage's timeout gave up on a call.  A Python thread cannot be
        killed: if the call is still running, its thread is abandoned with the
        old pool, and later frames get a fresh pool instead of queueing behind
        a hung function."""
        if cf.done() or self._pool is None:
            return
        self.abandoned_threads += 1
        old = self._pool
        self._pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency,
                                        thread_name_prefix="stage")
        old.shutdown(wait=False, cancel_futures=True)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class OnnxRunner:
    """Runs an ONNX model (CPUExecutionProvider) on the input tensor."""

    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        self.name = Path(cfg.target).stem
        self._session: Any = None
        self._input = cfg.input_name
        self._output: str | None = cfg.output_name
        self._pool: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        import onnxruntime as ort  # type: ignore[import-untyped]

        self._pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency,
                                        thread_name_prefix="onnx")
        loop = asyncio.get_running_loop()

        def load() -> Any:
            opts = ort.SessionOptions()
            return ort.InferenceSession(self.cfg.target, sess_options=opts,
                                        providers=["CPUExecutionProvider"])

        self._session = await loop.run_in_executor(self._pool, load)
        inputs = [i.name for i in self._session.get_inputs()]
        outputs = [o.name for o in self._session.get_outputs()]
        if self._input not in inputs:
            if len(inputs) == 1 and "input_name" not in self.cfg.model_fields_set:
                self._input = inputs[0]
            else:
                raise ValueError(f"model {self.cfg.target} has no input {self._input!r} "
                                 f"(inputs: {inputs})")
        if self._output is None:
            self._output = outputs[0]
        elif self._output not in outputs:
            raise ValueError(f"model {self.cfg.target} has no output {self._output!r} "
                             f"(outputs: {outputs})")
        log.info("onnx %s: input %s -> output %s", self.cfg.target, self._input, self._output)

    async def infer(self, inp: StageInput) -> np.ndarray | None:
        if self._session is None:
            raise RuntimeError("runner not started")
        loop = asyncio.get_running_loop()
        sess, iname, oname = self._session, self._input, self._output
        out = await loop.run_in_executor(self._pool, lambda: sess.run([oname], {iname: inp.array}))
        return np.asarray(out[0])

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._session = None
