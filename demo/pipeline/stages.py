"""The example pipeline's model stages: small, real, CPU-only, deterministic.

Every weight comes from a seeded ``numpy.random.default_rng`` (nothing is
downloaded); the same process computes the same outputs bit for bit, so a test
can compare what came out of the mesh with a direct call of these functions.

    vision_encoder  video frame uint8 HxWx3 -> 64-d   block-mean pool to 16x16,
                    a fixed 3x3 conv (8 filters) + ReLU, 2x2 pool, projection, tanh
    audio_frontend  PCM float32 (16 kHz) -> 64-d       Hann STFT (512/160), 64-band
                    mel filterbank, log, mean over time, standardised
    lidar_encoder   points float32 N x 4 -> 64-d       PointNet: shared MLP 4-32-64
                    (ReLU) + max pool; also built as ONNX by onnx_models.py
    fusion          latest embedding per modality per (stream, sequence) ->
                    192-d [video | audio | lidar] once all three are there
    decoder         192-d -> 16 class scores           linear + softmax

The python runner calls ``fn(array)``; ``fusion`` also needs the frame header
(which modality, stream and sequence an embedding belongs to), so the pipeline
runs it with :class:`FusionRunner` (see :func:`make_runner`).
"""

from __future__ import annotations

import functools
import threading
import time
import zlib
from collections import OrderedDict
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

EMBED_DIM = 64
FUSED_DIM = 3 * EMBED_DIM
SEED = 20240611

# vision
GRID = 16  # frames are block-mean pooled to GRID x GRID x 3
CONV_FILTERS = 8
# audio
SAMPLE_RATE = 16_000
N_FFT = 512
HOP = 160
N_MELS = EMBED_DIM
# lidar
LIDAR_HIDDEN = 32
# decoder
LABELS = (
    "nothing", "person", "cyclist", "car", "truck", "bus", "animal", "traffic-light",
    "speech", "siren", "horn", "alarm", "door", "footsteps", "music", "machinery",
)
N_CLASSES = len(LABELS)

# modality bytes (mmmesh.abi.Modality) of what fusion concatenates, in order
VIDEO, AUDIO, POINT_CLOUD = 3, 4, 5
FUSION_ORDER = (VIDEO, AUDIO, POINT_CLOUD)


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(name.encode())])


def _glorot(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    scale = np.sqrt(2.0 / (fan_in + fan_out))
    w: np.ndarray = (rng.standard_normal((fan_in, fan_out)) * scale).astype(np.float32)
    return w


# --------------------------------------------------------------------------
# Weights (cached; read-only so a stage cannot change them by accident)
# --------------------------------------------------------------------------
def _frozen(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    for a in arrays:
        a.setflags(write=False)
    return arrays


@functools.cache
def vision_weights() -> tuple[np.ndarray, ...]:
    r = _rng("vision")
    conv = _glorot(r, 3 * 3 * 3, CONV_FILTERS)  # (kh*kw*c, filters)
    conv_b = (r.standard_normal(CONV_FILTERS) * 0.05).astype(np.float32)
    pooled = ((GRID - 2) // 2) ** 2 * CONV_FILTERS  # 7*7*8 = 392
    proj = _glorot(r, pooled, EMBED_DIM)
    return _frozen(conv, conv_b, proj)


@functools.cache
def lidar_weights() -> tuple[np.ndarray, ...]:
    r = _rng("lidar")
    # the input scaling (metres to ~unit range) is folded into the first layer
    scale = np.array([1 / 40, 1 / 40, 1 / 2, 1], dtype=np.float32)[:, None]
    w1 = (_glorot(r, 4, LIDAR_HIDDEN) * scale * 3.0).astype(np.float32)
    b1 = (r.standard_normal(LIDAR_HIDDEN) * 0.05).astype(np.float32)
    w2 = _glorot(r, LIDAR_HIDDEN, EMBED_DIM)
    b2 = (r.standard_normal(EMBED_DIM) * 0.05).astype(np.float32)
    return _frozen(w1, b1, w2, b2)


CALIBRATION_TICKS = range(1000, 1012)


@functools.cache
def decoder_weights() -> tuple[np.ndarray, ...]:
    """A seeded projection whose logits are standardised per class over a few
    calibration scenes (batch-norm folded into the weights), so that the
    synthetic scenes do not all land in one class."""
    r = _rng("decoder")
    w = _glorot(r, FUSED_DIM, N_CLASSES).astype(np.float64)
    fused = np.stack([_fused_numpy(t) for t in CALIBRATION_TICKS]).astype(np.float64)
    logits = fused @ w
    mu, sd = logits.mean(axis=0), logits.std(axis=0) + 1e-6
    gain = 2.0
    w = w / sd * gain
    b = -mu / sd * gain
    return _frozen(w.astype(np.float32), b.astype(np.float32))


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


@functools.cache
def mel_filterbank() -> np.ndarray:
    """(N_MELS, N_FFT//2+1) triangular HTK-mel filters, 20 Hz .. Nyquist, area-normalised."""
    n_bins = N_FFT // 2 + 1
    freqs = np.linspace(0.0, SAMPLE_RATE / 2, n_bins)
    mels = np.linspace(_hz_to_mel(np.array(20.0)), _hz_to_mel(np.array(SAMPLE_RATE / 2.0)),
                       N_MELS + 2)
    edges = _mel_to_hz(mels)
    fb = np.zeros((N_MELS, n_bins))
    for i in range(N_MELS):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        up = (freqs - lo) / (mid - lo)
        down = (hi - freqs) / (hi - mid)
        fb[i] = np.maximum(0.0, np.minimum(up, down)) * (2.0 / (hi - lo))
    out = fb.astype(np.float32)
    out.setflags(write=False)
    return out


@functools.cache
def _hann() -> np.ndarray:
    w = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)
    w.setflags(write=False)
    return w


# --------------------------------------------------------------------------
# Stages (np.ndarray -> np.ndarray | None)
# --------------------------------------------------------------------------
def vision_encoder(frame: np.ndarray) -> np.ndarray:
    """A video frame (uint8, H x W x 3, H and W >= 16) -> float32 (64,)."""
    x = np.asarray(frame)
    if x.ndim != 3 or x.shape[2] != 3 or x.dtype != np.uint8:
        raise ValueError(f"expected a uint8 HxWx3 frame, got {x.dtype} {x.shape}")
    h, w = x.shape[0] // GRID, x.shape[1] // GRID
    if h == 0 or w == 0:
        raise ValueError(f"frame {x.shape[:2]} is smaller than {GRID}x{GRID}")
    # block means: sum rows of each block, then columns (integer sums are exact)
    rows = x[: h * GRID, : w * GRID].reshape(GRID, h, w * GRID, 3).sum(axis=1, dtype=np.uint32)
    blocks = rows.reshape(GRID, GRID, w, 3).sum(axis=2, dtype=np.uint32)
    pooled = blocks.astype(np.float32) * np.float32(1.0 / (255.0 * h * w)) - np.float32(0.5)
    conv, conv_b, proj = vision_weights()
    patches = sliding_window_view(pooled, (3, 3), axis=(0, 1))  # (14, 14, 3, 3, 3): c, kh, kw
    cols = np.ascontiguousarray(patches.transpose(0, 1, 3, 4, 2)).reshape(-1, 27)
    feat = np.maximum(cols @ conv + conv_b, 0.0).reshape(GRID - 2, GRID - 2, CONV_FILTERS)
    feat = feat.reshape(7, 2, 7, 2, CONV_FILTERS).mean(axis=(1, 3))  # 2x2 average pool
    emb = np.tanh(feat.reshape(-1) @ proj)
    out: np.ndarray = emb.astype(np.float32)
    return out


def audio_frontend(pcm: np.ndarray) -> np.ndarray:
    """A mono PCM chunk (float32 in [-1, 1], 16 kHz) -> float32 (64,) log-mel features."""
    x = np.asarray(pcm, dtype=np.float32).reshape(-1)
    if x.size == 0:
        raise ValueError("empty audio chunk")
    pad = N_FFT // 2
    x = np.pad(x, pad, mode="reflect" if x.size > pad else "constant")
    if x.size < N_FFT:
        x = np.pad(x, (0, N_FFT - x.size))
    frames = sliding_window_view(x, N_FFT)[::HOP] * _hann()  # (T, 512)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2  # (T, 257)
    mel = power.astype(np.float32) @ mel_filterbank().T  # (T, 64)
    feat = np.log(mel + np.float32(1e-6)).mean(axis=0)
    feat = (feat - feat.mean()) / (feat.std() + np.float32(1e-5))
    out: np.ndarray = feat.astype(np.float32)
    return out


def lidar_encoder(points: np.ndarray) -> np.ndarray:
    """A point cloud (float32, N x 4: x, y, z, intensity) -> float32 (64,).

    The numpy twin of ``lidar_encoder.onnx`` (see onnx_models.py)."""
    p = np.asarray(points, dtype=np.float32)
    if p.ndim != 2 or p.shape[1] != 4 or p.shape[0] == 0:
        raise ValueError(f"expected an N x 4 point cloud, got {p.shape}")
    w1, b1, w2, b2 = lidar_weights()
    h = np.maximum(p @ w1 + b1, 0.0)
    h = np.maximum(h @ w2 + b2, 0.0)
    out: np.ndarray = h.max(axis=0).astype(np.float32)
    return out


def decoder(fused: np.ndarray) -> np.ndarray:
    """The fused 192-d embedding -> float32 (16,) class probabilities."""
    z = np.asarray(fused, dtype=np.float32).reshape(-1)
    if z.size != FUSED_DIM:
        raise ValueError(f"expected {FUSED_DIM} values, got {z.size}")
    w, b = decoder_weights()
    logits = z @ w + b
    e = np.exp(logits - logits.max())
    out: np.ndarray = (e / e.sum()).astype(np.float32)
    return out


def token(scores: np.ndarray) -> tuple[int, str]:
    """(class id, label) of the decoder's scores."""
    i = int(np.argmax(scores))
    return i, LABELS[i]


def identity(x: np.ndarray) -> np.ndarray:
    """Returns its input (the sidecar benchmark's stage)."""
    return x


async def identity_async(x: np.ndarray) -> np.ndarray:
    return x


# --------------------------------------------------------------------------
# Fusion: stateful, aligned by (stream id, sequence)
# --------------------------------------------------------------------------
class Fusion:
    """Keeps the latest embedding per modality for each (stream id, sequence)
    and returns the 192-d concatenation [video | audio | lidar] as soon as all
    three are there (then forgets that sequence).  Sequences still incomplete
    after ``window_s`` seconds, or beyond the ``max_pending`` newest, are
    dropped (counted in ``expired``).  Thread-safe."""

    def __init__(self, window_s: float = 2.0, max_pending: int = 256) -> None:
        self.window_s = window_s
        self.max_pending = max_pending
        self._pending: OrderedDict[tuple[int, int], tuple[float, dict[int, np.ndarray]]] = (
            OrderedDict())
        self._lock = threading.Lock()
        self.emitted = 0
        self.expired = 0

    def push(self, modality: int, stream_id: int, sequence: int,
             embedding: np.ndarray, now: float | None = None) -> np.ndarray | None:
        if modality not in FUSION_ORDER:
            raise ValueError(f"fusion takes video, audio and point_cloud, not modality {modality}")
        emb = np.array(embedding, dtype=np.float32).reshape(-1)  # a copy: inputs are views
        if emb.size != EMBED_DIM:
            raise ValueError(f"expected a {EMBED_DIM}-d embedding, got {emb.size}")
        now = time.monotonic() if now is None else now
        key = (stream_id, sequence)
        with self._lock:
            entry = self._pending.get(key)
            if entry is None:
                entry = (now, {})
                self._pending[key] = entry
            parts = entry[1]
            parts[modality] = emb
            if len(parts) == len(FUSION_ORDER):
                del self._pending[key]
                self.emitted += 1
                return np.concatenate([parts[m] for m in FUSION_ORDER])
            self._expire(now)
            return None

    def _expire(self, now: float) -> None:
        p = self._pending
        while p:
            key, (t0, _) = next(iter(p.items()))
            if len(p) > self.max_pending or now - t0 > self.window_s:
                del p[key]
                self.expired += 1
            else:
                break

    @property
    def pending(self) -> int:
        return len(self._pending)


_FUSION = Fusion()


def fusion(embedding: np.ndarray, header: Any = None) -> np.ndarray | None:
    """The fusion stage as a function of (embedding, frame header).

    A python runner that only passes the array cannot run it (the header says
    which modality, stream and sequence the embedding belongs to): the
    pipeline runs it with :class:`FusionRunner`."""
    if header is None:
        raise TypeError("fusion needs the frame header (modality, stream id, sequence): "
                        "run it with demo.pipeline.stages.FusionRunner")
    return _FUSION.push(int(header.modality), int(header.stream_id or 0),
                        int(header.sequence or 0), embedding)


class FusionRunner:
    """A sidecar Runner (``sidecar.contract.Runner``) around :class:`Fusion`:
    it reads modality, stream id and sequence from each frame's header."""

    name = "fusion"

    def __init__(self, window_s: float = 2.0, max_pending: int = 256) -> None:
        self.fusion = Fusion(window_s, max_pending)

    async def start(self) -> None:
        pass

    async def infer(self, inp: Any) -> np.ndarray | None:
        h = inp.header
        return self.fusion.push(int(h.modality), int(h.stream_id or 0), int(h.sequence or 0),
                                inp.array)

    async def close(self) -> None:
        pass


def make_runner(cfg: Any) -> Any:
    """The Runner for a pipeline sidecar config: :class:`FusionRunner` for the
    fusion stage, else what the sidecar would build from ``cfg.runner``."""
    if cfg.runner.kind == "python" and cfg.runner.target.endswith(":fusion"):
        return FusionRunner()
    from sidecar.runners import make_runner as sidecar_runner

    return sidecar_runner(cfg.runner)


# --------------------------------------------------------------------------
# Seeded sensor data (the sources and the tests use the same generators)
# --------------------------------------------------------------------------
VIDEO_SHAPE = (360, 640, 3)
AUDIO_CHUNK = 800  # 50 ms at 16 kHz
LIDAR_POINTS = 16_384


def video_frame(seq: int, shape: tuple[int, int, int] = VIDEO_SHAPE) -> np.ndarray:
    """A synthetic camera frame: a moving gradient plus seeded noise."""
    r = np.random.default_rng([SEED, 1, seq])
    hh, ww, _ = shape
    yy = np.linspace(0, 1, hh, dtype=np.float32)[:, None]
    xx = np.linspace(0, 1, ww, dtype=np.float32)[None, :]
    phase = seq * 0.9
    base = np.stack([np.sin(6 * xx + phase) * np.cos(4 * yy),
                     np.cos(5 * yy - phase) + 0 * xx,
                     np.sin(3 * (xx + yy) + 2 * phase)], axis=-1)
    img = (base + 1.0) * 100.0 + r.integers(0, 56, size=shape, dtype=np.uint8)
    return np.clip(img, 0, 255).astype(np.uint8)


def audio_chunk(seq: int, n: int = AUDIO_CHUNK) -> np.ndarray:
    """A synthetic voice-like chunk: two harmonics whose pitch moves with seq, plus noise."""
    r = np.random.default_rng([SEED, 2, seq])
    t = (np.arange(n) + seq * n) / SAMPLE_RATE
    f0 = 110.0 + 220.0 * ((seq * 0.37) % 1.0)
    x = 0.4 * np.sin(2 * np.pi * f0 * t) + 0.2 * np.sin(2 * np.pi * 3.1 * f0 * t)
    x += 0.02 * r.standard_normal(n)
    return x.astype(np.float32)


def lidar_sweep(seq: int, n: int = LIDAR_POINTS) -> np.ndarray:
    """A synthetic sweep: a ground plane plus a few seeded boxes, x y z intensity."""
    r = np.random.default_rng([SEED, 3, seq])
    pts = np.empty((n, 4), dtype=np.float32)
    ang = r.uniform(0, 2 * np.pi, n)
    dist = r.uniform(2, 60, n)
    pts[:, 0] = dist * np.cos(ang)
    pts[:, 1] = dist * np.sin(ang)
    pts[:, 2] = r.normal(-1.7, 0.05, n)
    k = n // 4  # a quarter of the points hit objects
    centres = r.uniform(-30, 30, (8, 3)).astype(np.float32)
    centres[:, 2] = 0.0
    idx = r.integers(0, 8, k)
    pts[:k, :3] = centres[idx] + r.normal(0, 0.8, (k, 3))
    pts[:, 3] = r.uniform(0, 1, n)
    return pts


def _fused_numpy(seq: int) -> np.ndarray:
    return np.concatenate([vision_encoder(video_frame(seq)), audio_frontend(audio_chunk(seq)),
                           lidar_encoder(lidar_sweep(seq))])


def reference(seq: int, *, lidar: Any = None) -> dict[str, np.ndarray]:
    """Every stage's output for tick ``seq``, computed directly in this process.

    ``lidar`` replaces :func:`lidar_encoder` (e.g. the ONNX model's session)."""
    v = vision_encoder(video_frame(seq))
    a = audio_frontend(audio_chunk(seq))
    pts = lidar_sweep(seq)
    lid = lidar_encoder(pts) if lidar is None else np.asarray(lidar(pts), dtype=np.float32)
    fused = np.concatenate([v, a, lid])
    return {"video": v, "audio": a, "lidar": lid, "fused": fused, "scores": decoder(fused)}
