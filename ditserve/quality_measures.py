"""What `ditserve audit-quality` measures of a result at a quality level against the same request's lossless result,
both as frames_and_wav (ditcore.media: PNG frames and a 16-bit PCM WAV, lossless, so a difference is the model's):

- `psnr_db`: PSNR of every frame together (torchmetrics' `peak_signal_noise_ratio`, data range 1); `inf` when the
  frames are identical (it meets any min_psnr_db);
- `ssim`: SSIM over the frames (torchmetrics' `structural_similarity_index_measure`, Gaussian 11x11 window, or the
  largest odd one the canvas holds; in float32, SSIM_CHUNK_FRAMES frames a call, their means averaged); 1.0 when
  identical;
- `audio_snr_db`: SNR of the level's waveform against lossless (torchmetrics' `signal_noise_ratio`); `inf` when
  identical;
- `audio_corr`: Pearson correlation of the two waveforms (torchmetrics' `pearson_corrcoef`); 1.0 when identical.

Imports torch and torchmetrics: a client command imports this module only once it has work for it.
"""

from __future__ import annotations

import io
import math
import wave
import zipfile
from dataclasses import dataclass

import numpy as np

SSIM_CHUNK_FRAMES = 8
"""Frames per SSIM call, in float32: a 768 x 1344 frame takes about 1.1 s on 2 CPU cores, in float64 about 11 s, and
float64 over the released canvas's 345 frames at once would hold tens of GB."""


@dataclass(frozen=True)
class FramesAndWav:
    """A decoded frames_and_wav result: frames (F, H, W, 3) uint8 and the waveform (channels, samples) in [-1, 1)."""

    frames: np.ndarray
    audio: np.ndarray
    sampling_rate: int


def read_frames_and_wav(data: bytes) -> FramesAndWav:
    """The frames (in name order) and the waveform of a frames_and_wav ZIP; ValueError for another layout."""
    from PIL import Image

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = sorted(n for n in archive.namelist() if n.startswith("frames/") and n.endswith(".png"))
        if not names or "audio.wav" not in archive.namelist():
            raise ValueError("not a frames_and_wav result: frames/*.png and audio.wav expected")
        frames = np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB")) for n in names])
        with wave.open(io.BytesIO(archive.read("audio.wav"))) as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"audio.wav: {8 * w.getsampwidth()}-bit samples; 16-bit PCM expected")
            channels, rate = w.getnchannels(), w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = pcm.reshape(-1, channels).T.astype(np.float32) / 32768.0
    return FramesAndWav(frames, audio, rate)


def compare(reference: FramesAndWav, other: FramesAndWav) -> dict[str, float]:
    """psnr_db, ssim, audio_snr_db, audio_corr of `other` against `reference` (ValueError when their shapes
    differ: not the same request)."""
    import torch
    from torchmetrics.functional import pearson_corrcoef
    from torchmetrics.functional.audio import signal_noise_ratio
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    if reference.frames.shape != other.frames.shape or reference.audio.shape != other.audio.shape:
        raise ValueError(f"results of different shapes: frames {reference.frames.shape} vs {other.frames.shape}, "
                         f"audio {reference.audio.shape} vs {other.audio.shape}")  # fmt: skip
    out: dict[str, float] = {}
    if np.array_equal(reference.frames, other.frames):
        out.update(psnr_db=math.inf, ssim=1.0)
    else:
        target = torch.from_numpy(reference.frames).permute(0, 3, 1, 2).double() / 255.0
        preds = torch.from_numpy(other.frames).permute(0, 3, 1, 2).double() / 255.0
        kernel = min(11, *(d if d % 2 else d - 1 for d in target.shape[-2:]))
        out["psnr_db"] = float(peak_signal_noise_ratio(preds, target, data_range=1.0))
        del target, preds
        total = 0.0  # torchmetrics' SSIM is the mean of each frame's: summed over chunks of frames, then divided
        for i in range(0, len(reference.frames), SSIM_CHUNK_FRAMES):
            preds_f, target_f = (torch.from_numpy(f[i : i + SSIM_CHUNK_FRAMES]).permute(0, 3, 1, 2).float() / 255.0
                                 for f in (other.frames, reference.frames))  # fmt: skip
            ssim = structural_similarity_index_measure(preds_f, target_f, data_range=1.0, kernel_size=kernel)
            assert isinstance(ssim, torch.Tensor)  # no full image asked for
            total += float(ssim.double()) * len(preds_f)
        out["ssim"] = total / len(reference.frames)
    if np.array_equal(reference.audio, other.audio):
        out.update(audio_snr_db=math.inf, audio_corr=1.0)
    else:
        target_a = torch.from_numpy(reference.audio.reshape(-1)).double()
        preds_a = torch.from_numpy(other.audio.reshape(-1)).double()
        out["audio_snr_db"] = float(signal_noise_ratio(preds_a, target_a))
        out["audio_corr"] = float(pearson_corrcoef(preds_a, target_a))  # NaN for a constant waveform: fails
    return {k: v if math.isinf(v) or math.isnan(v) else round(v, 4) for k, v in out.items()}
