"""Builds the pipeline's ONNX models from the seeded weights in stages.py.

    python -m demo.pipeline.onnx_models [--out DIR]   (default: examples/pipeline, where
                                                     its sidecar configs look)

writes ``lidar_encoder.onnx`` (PointNet: points [N, 4] -> embedding [64]) and
``decoder.onnx`` (fused [192] -> scores [16]), each atomically (a temporary
file in the same directory, fsync, rename), after checking them with
``onnx.checker`` and, when onnxruntime is installed, against the numpy stages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from demo.pipeline import stages
from mmmesh import files

OPSET = 17  # ReduceMax takes `axes` as an attribute up to opset 17
IR_VERSION = 8  # readable by onnxruntime >= 1.10
EXAMPLES = Path("examples") / "pipeline"  # relative to the checkout (run from its root)


def lidar_model() -> onnx.ModelProto:
    w1, b1, w2, b2 = stages.lidar_weights()
    inits = [numpy_helper.from_array(np.asarray(a), name)
             for a, name in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))]
    nodes = [
        helper.make_node("MatMul", ["points", "w1"], ["h1m"]),
        helper.make_node("Add", ["h1m", "b1"], ["h1a"]),
        helper.make_node("Relu", ["h1a"], ["h1"]),
        helper.make_node("MatMul", ["h1", "w2"], ["h2m"]),
        helper.make_node("Add", ["h2m", "b2"], ["h2a"]),
        helper.make_node("Relu", ["h2a"], ["h2"]),
        helper.make_node("ReduceMax", ["h2"], ["embedding"], axes=[0], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "lidar_encoder",
        [helper.make_tensor_value_info("points", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [stages.EMBED_DIM])],
        inits,
    )
    return _model(graph, "PointNet-style LiDAR encoder: shared MLP 4-32-64 + max pool")


def decoder_model() -> onnx.ModelProto:
    w, b = stages.decoder_weights()
    inits = [numpy_helper.from_array(np.asarray(w), "w"), numpy_helper.from_array(np.asarray(b), "b")]
    nodes = [
        helper.make_node("Reshape", ["fused", "flat"], ["z"]),
        helper.make_node("MatMul", ["z", "w"], ["logits_m"]),
        helper.make_node("Add", ["logits_m", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=-1),
    ]
    inits.append(numpy_helper.from_array(np.array([stages.FUSED_DIM], dtype=np.int64), "flat"))
    graph = helper.make_graph(
        nodes, "decoder",
        [helper.make_tensor_value_info("fused", TensorProto.FLOAT, [stages.FUSED_DIM])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [stages.N_CLASSES])],
        inits,
    )
    return _model(graph, "Linear + softmax decoder over the fused embedding")


def _model(graph: onnx.GraphProto, doc: str) -> onnx.ModelProto:
    graph.doc_string = doc
    model = helper.make_model(graph, producer_name="mmmesh-examples",
                              opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def write_atomic(model: onnx.ModelProto, path: Path) -> Path:
    return files.write_atomic(path, model.SerializeToString())


def verify(lidar_path: Path, decoder_path: Path) -> None:
    """The ONNX models agree with the numpy stages (skipped without onnxruntime)."""
    try:
        import onnxruntime as ort  # type: ignore[import-untyped]
    except ImportError:
        return
    pts = stages.lidar_sweep(0, 1000)
    s = ort.InferenceSession(str(lidar_path), providers=["CPUExecutionProvider"])
    got = s.run(None, {"points": pts})[0]
    np.testing.assert_allclose(got, stages.lidar_encoder(pts), rtol=1e-4, atol=1e-5)
    z = np.random.default_rng(0).standard_normal(stages.FUSED_DIM).astype(np.float32)
    s = ort.InferenceSession(str(decoder_path), providers=["CPUExecutionProvider"])
    got = s.run(None, {"fused": z})[0]
    np.testing.assert_allclose(got, stages.decoder(z), rtol=1e-4, atol=1e-6)


def build(out_dir: str | Path = EXAMPLES) -> dict[str, Path]:
    """Writes both models into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    paths = {
        "lidar_encoder": write_atomic(lidar_model(), out / "lidar_encoder.onnx"),
        "decoder": write_atomic(decoder_model(), out / "decoder.onnx"),
    }
    verify(paths["lidar_encoder"], paths["decoder"])
    return paths


def ensure(out_dir: str | Path = EXAMPLES) -> dict[str, Path]:
    """The models in ``out_dir``, built if missing."""
    out = Path(out_dir)
    paths = {"lidar_encoder": out / "lidar_encoder.onnx", "decoder": out / "decoder.onnx"}
    if all(p.is_file() for p in paths.values()):
        return paths
    return build(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(EXAMPLES), help="output directory (default: %(default)s)")
    a = p.parse_args(argv)
    for name, path in build(a.out).items():
        print(f"{name}: {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
