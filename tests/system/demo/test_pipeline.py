"""The example multimodal pipeline: its stages, its ONNX models, its sidecar
configs, and the whole pipeline across three network-namespace nodes
(sensors -> edge -> core) with the mmmesh dataplane on the sensors' uplink,
checked on its OUTPUTS: the decoder's scores for seeded sensor data equal a
direct in-process computation of the same stages."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from demo.pipeline import onnx_models as make_onnx
from demo.pipeline import run as pl
from demo.pipeline import stages
from sidecar.config import load_config

CONFIGS = sorted(Path("examples/pipeline/config").glob("*.yaml"))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_onnx.build(tmp_path_factory.mktemp("onnx"))


def _session(path: Path):  # type: ignore[no-untyped-def]
    import onnxruntime as ort  # type: ignore[import-untyped]

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    return lambda x: s.run(None, {name: np.ascontiguousarray(x, dtype=np.float32)})[0]


# --------------------------------------------------------------------------
# Stages and models (no privileges needed)
# --------------------------------------------------------------------------
def test_stage_shapes_and_determinism() -> None:
    v = stages.vision_encoder(stages.video_frame(3))
    a = stages.audio_frontend(stages.audio_chunk(3))
    lid = stages.lidar_encoder(stages.lidar_sweep(3))
    for e in (v, a, lid):
        assert e.shape == (stages.EMBED_DIM,) and e.dtype == np.float32
        assert np.all(np.isfinite(e))
    r1, r2 = stages.reference(5), stages.reference(5)
    for k in r1:
        np.testing.assert_array_equal(r1[k], r2[k])
    s = r1["scores"]
    assert s.shape == (stages.N_CLASSES,) and abs(float(s.sum()) - 1.0) < 1e-5
    # different scenes give different answers (the decoder is not constant)
    assert len({stages.token(stages.reference(i)["scores"])[0] for i in range(8)}) >= 3


def test_audio_frontend_hears_pitch() -> None:
    """A pure tone lights up the mel band that contains it."""
    fb = stages.mel_filterbank()
    bin_hz = stages.SAMPLE_RATE / stages.N_FFT
    t = np.arange(stages.AUDIO_CHUNK) / stages.SAMPLE_RATE
    for f in (300.0, 1000.0, 3000.0):
        feat = stages.audio_frontend(np.sin(2 * np.pi * f * t).astype(np.float32))
        expected = int(np.argmax(fb[:, round(f / bin_hz)]))
        assert abs(int(np.argmax(feat)) - expected) <= 1, (f, np.argmax(feat), expected)


def test_vision_encoder_rejects_bad_frames() -> None:
    with pytest.raises(ValueError):
        stages.vision_encoder(np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(ValueError):
        stages.vision_encoder(np.zeros((32, 32, 3), np.float32))
    # any size >= 16x16 works, and the size of the frame matters little
    a = stages.vision_encoder(stages.video_frame(1, (360, 640, 3)))
    b = stages.vision_encoder(stages.video_frame(1, (368, 640, 3)))
    assert np.corrcoef(a, b)[0, 1] > 0.9


def test_onnx_models_match_numpy(models: dict[str, Path]) -> None:
    lidar, dec = _session(models["lidar_encoder"]), _session(models["decoder"])
    for n in (1, 7, stages.LIDAR_POINTS):
        pts = stages.lidar_sweep(n, n)
        np.testing.assert_allclose(lidar(pts), stages.lidar_encoder(pts), rtol=1e-4, atol=1e-5)
    z = stages.reference(2)["fused"]
    np.testing.assert_allclose(dec(z), stages.decoder(z), rtol=1e-4, atol=1e-7)


def test_make_onnx_is_atomic_and_idempotent(tmp_path: Path) -> None:
    paths = make_onnx.build(tmp_path)
    first = {k: p.read_bytes() for k, p in paths.items()}
    assert make_onnx.ensure(tmp_path) == paths  # present: not rebuilt
    make_onnx.build(tmp_path)
    assert {k: p.read_bytes() for k, p in paths.items()} == first  # seeded: same bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoder.onnx", "lidar_encoder.onnx"]


def test_fusion_aligns_by_stream_and_sequence() -> None:
    f = stages.Fusion(window_s=1.0, max_pending=4)
    e = {m: np.full(stages.EMBED_DIM, m, np.float32) for m in stages.FUSION_ORDER}
    V, A, L = stages.FUSION_ORDER
    assert f.push(A, 1, 0, e[A], now=0.0) is None
    assert f.push(V, 1, 1, e[V], now=0.0) is None  # another sequence
    assert f.push(L, 2, 0, e[L], now=0.0) is None  # another stream
    assert f.push(V, 1, 0, e[V], now=0.0) is None
    out = f.push(L, 1, 0, e[L] + 0, now=0.1)
    assert out is not None and out.shape == (stages.FUSED_DIM,)
    np.testing.assert_array_equal(out, np.concatenate([e[V], e[A], e[L]]))  # fixed order
    assert f.pending == 2 and f.emitted == 1
    # stale sequences are forgotten after the window, and never emitted
    assert f.push(A, 1, 9, e[A], now=5.0) is None
    assert f.pending == 1 and f.expired == 2
    with pytest.raises(ValueError):
        f.push(7, 1, 0, e[V])
    with pytest.raises(TypeError):
        stages.fusion(e[V])  # without the header


def test_fusion_runner_reads_headers() -> None:
    from mmmesh.wire import Header
    from sidecar.contract import StageInput

    r = stages.FusionRunner()

    async def main() -> list[np.ndarray | None]:
        await r.start()
        outs = []
        for m in stages.FUSION_ORDER:
            h = Header(modality=m, stream_id=3, sequence=4)
            outs.append(await r.infer(StageInput(h, np.ones(64, np.float32) * m, 0, "x")))
        await r.close()
        return outs

    outs = asyncio.run(main())
    assert outs[0] is None and outs[1] is None and outs[2] is not None
    assert outs[2][0] == stages.VIDEO and outs[2][-1] == stages.POINT_CLOUD


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_stage_configs_are_valid(path: Path) -> None:
    cfg = load_config(path)
    if cfg.runner.kind == "python":
        mod, _, fn = cfg.runner.target.partition(":")
        assert mod == "demo.pipeline.stages" and callable(getattr(stages, fn))
    else:
        assert cfg.runner.kind == "onnx" and Path(cfg.runner.target).name in (
            "lidar_encoder.onnx", "decoder.onnx")
    assert len(cfg.outputs) == 1


def test_stage_configs_wire_the_pipeline(models: dict[str, Path]) -> None:
    cfgs = pl.load_stage_configs(models["decoder"].parent)
    fusion = cfgs["fusion.yaml"]
    for name in pl.EDGE_STAGES:  # every encoder feeds fusion on the core node
        (out,) = cfgs[name].outputs
        assert out.address == f"{pl.CORE_ADDR}:{pl._port(fusion)}"
    assert cfgs["fusion.yaml"].outputs[0].address.endswith(f":{pl._port(cfgs['decoder.yaml'])}")
    assert cfgs["decoder.yaml"].outputs[0].address == f"127.0.0.1:{pl.RESULTS_PORT}"
    assert Path(cfgs["lidar.yaml"].runner.target) == models["lidar_encoder"]
    # the encoders' outputs carry their source's modality (fusion aligns on it)
    assert {cfgs[n].outputs[0].modality for n in pl.EDGE_STAGES} == {"video", "audio",
                                                                     "point_cloud"}


def test_pipeline_policy_fits_small_links() -> None:
    from mmmesh.policy import Rate

    p = pl.pipeline_policy(None, "up0", 100_000_000)
    assert p.link.device == "up0" and int(Rate(p.link.rate)) == 100_000_000
    assert sum(int(Rate(c.rate)) for c in p.classes) <= 90_000_000
    big = pl.pipeline_policy(None, "up0", 1_000_000_000)
    assert {c.name: str(c.rate) for c in big.classes}["video"] == "150mbit"


# --------------------------------------------------------------------------
# The pipeline across three netns nodes (root, BPF)
# --------------------------------------------------------------------------
def _privileged() -> None:
    from testkit.privileged import require_privileged

    require_privileged()


TICKS = 6


@pytest.mark.privileged
@pytest.mark.timeout(120)
def test_pipeline_end_to_end_across_three_nodes(models: dict[str, Path]) -> None:
    _privileged()
    from demo import netlab
    from mmmesh.dataplane import Dataplane

    cfg = pl.PipelineConfig(exact_ticks=TICKS, tick_s=0.1, flood_factor=0.0,
                            rate_bps=300_000_000)
    stage_cfgs = pl.load_stage_configs(models["decoder"].parent)
    policy = pl.pipeline_policy(None, pl.UPLINK, cfg.rate_bps)
    with pl.Topology(prefix=f"mmt{os.getpid()}-") as topo:
        dp = Dataplane(pl.UPLINK, topo.sensors)
        dp.up(policy)
        try:
            res = pl.run_phase(topo, cfg, stage_cfgs, keep_scores=True)
            st = dp.status(policy)
        finally:
            dp.down()
        names = set(topo.namespaces)

    assert not names & set(netlab.list_netns()), "namespaces left behind"

    # what the decoder sent, per sequence, against the same stages run here
    rows = {r["seq"]: r for r in res["results"]["rows"]}
    assert sorted(rows) == list(range(TICKS)), rows.keys()
    lidar_onnx, decoder_onnx = _session(models["lidar_encoder"]), _session(models["decoder"])
    for seq, row in rows.items():
        assert "error" not in row, row
        assert row["stream"] == pl.STREAM_ID
        ref = stages.reference(seq, lidar=lidar_onnx)
        got = np.array(row["scores"], dtype=np.float32)
        np.testing.assert_allclose(got, decoder_onnx(ref["fused"]), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got, ref["scores"], rtol=1e-4, atol=1e-6)
        assert stages.token(got) == stages.token(ref["scores"])
        # and the ONNX LiDAR encoder is the numpy one
        np.testing.assert_allclose(ref["lidar"], stages.lidar_encoder(stages.lidar_sweep(seq)),
                                   rtol=1e-4, atol=1e-5)

    # every stage saw every frame, no errors, and drained cleanly
    sc = res["stages"]
    for name in ("vision", "audio", "lidar"):
        c = sc[name]["counters"]
        assert c["stage"]["frames"] == TICKS and c["stage"]["outputs"] == TICKS, (name, c)
        assert not c["stage"]["errors"] and sc[name]["clean"]
    fu = sc["fusion"]["counters"]["stage"]
    assert (fu["frames"], fu["outputs"], fu["no_output"]) == (3 * TICKS, TICKS, 2 * TICKS)
    assert sc["decoder"]["counters"]["stage"]["outputs"] == TICKS
    for m, r in res["modalities"].items():
        assert r["produced"] == r["arrived"] == TICKS, (m, r)

    # the frames crossed the shaped uplink in their modality's class
    classes = {c.name: c for c in st.classes}
    for cls in ("voice", "video", "lidar"):
        assert classes[cls].egress_packets > 0, (cls, classes)
