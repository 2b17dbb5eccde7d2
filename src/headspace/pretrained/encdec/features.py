"""Whisper's input: PCM WAV files resampled to 16 kHz, and log-mel features computed as transformers'
``WhisperFeatureExtractor`` computes them (issue #40).

A file at another rate ``r`` is resampled by ``scipy.signal.resample_poly(x, 16000 / g, r / g)``
(``g = gcd(16000, r)``): upsampling by ``16000 / g``, scipy's default Kaiser-windowed (beta 5) FIR
low-pass at the lower Nyquist rate, then downsampling by ``r / g`` (polyphase, float64).

For a waveform ``x`` at 16 kHz, zero-padded (or cut) to ``N = 30 s * 16000 = 480000`` samples::

    S     = |STFT(x)|^2        n_fft 400, hop 160, periodic Hann window, centred (reflect padding)
                               [201, 3001] -> the last frame dropped: [201, 3000]
    M     = F^T S              F: [201, n_mels] slaney-normalised triangles on the slaney mel scale, 0..8 kHz
    L     = log10(max(M, 1e-10))
    L     = max(L, max(L) - 8)
    feats = (L + 4) / 4        [n_mels, 3000]
"""

from __future__ import annotations

import math
import os
import wave
from pathlib import Path

import torch
from torch import Tensor

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE
_SAMPLE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _hz_to_mel(f: Tensor) -> Tensor:
    """The slaney mel scale: linear (3 mel per 200 Hz) below 1 kHz, logarithmic above."""
    log_step = 27.0 / math.log(6.4)
    return torch.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + torch.log(f.clamp(min=1e-10) / 1000.0) * log_step)


def _mel_to_hz(m: Tensor) -> Tensor:
    log_step = 27.0 / math.log(6.4)
    return torch.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * torch.exp((m - 15.0) / log_step))


def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> Tensor:
    """The mel filter bank F [n_fft // 2 + 1, n_mels] (float64): triangles between ``n_mels + 2`` points
    evenly spaced on the slaney mel scale from 0 Hz to ``sample_rate / 2``, each scaled by
    ``2 / (f_right - f_left)`` (slaney normalisation)."""
    fft_freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    top = _hz_to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64))
    points = _mel_to_hz(torch.linspace(0.0, float(top), n_mels + 2, dtype=torch.float64))
    diff = points[1:] - points[:-1]
    slopes = points[None, :] - fft_freqs[:, None]  # [n_freqs, n_mels + 2]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    triangles = torch.clamp(torch.minimum(down, up), min=0.0)  # [n_freqs, n_mels]
    return triangles * (2.0 / (points[2:] - points[:-2]))[None, :]


def log_mel(audio: Tensor, n_mels: int = 80) -> Tensor:
    """Log-mel features [n_mels, 3000] of a mono 16 kHz waveform [samples] (module docstring)."""
    if not isinstance(audio, Tensor) or audio.dim() != 1 or not audio.is_floating_point():
        got = type(audio).__name__ if not isinstance(audio, Tensor) else f"{audio.dtype} {list(audio.shape)}"
        raise ValueError(f"audio must be a 1-D floating-point tensor of 16 kHz samples; got {got}")
    x = audio.float()[:N_SAMPLES]
    x = torch.nn.functional.pad(x, (0, N_SAMPLES - x.shape[0]))
    stft = torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)  # [201, 3001]
    power = (stft[:, :-1].abs() ** 2).contiguous()  # [201, 3000]
    mel = mel_filters(n_mels).float().T @ power  # [n_mels, 3000]
    log_spec = mel.clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def resample(x: Tensor, rate: int, target: int = SAMPLE_RATE) -> Tensor:
    """``x`` [n] sampled at ``rate`` Hz, resampled to ``target`` Hz [ceil(n * target / rate)] (float32) by
    ``scipy.signal.resample_poly`` (module docstring); ``x`` itself when the rates are equal."""
    if rate == target:
        return x.float()
    from scipy.signal import resample_poly  # a run-time dependency (pyproject.toml); imported when needed

    g = math.gcd(target, rate)
    y = resample_poly(x.double().numpy(), target // g, rate // g)  # [ceil(n * target / rate)]
    return torch.from_numpy(y).float()


def read_wav(path: str | os.PathLike[str]) -> Tensor:
    """The samples [n] in [-1, 1] (float32) of a PCM WAV file (channels averaged), resampled to 16 kHz
    (:func:`resample`) when the file holds another rate.

    ValueError, one line naming the file, for a missing, unreadable, non-PCM or empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such audio file (a 16 kHz PCM .wav file expected)")
    try:
        with wave.open(str(p), "rb") as w:
            rate, channels, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError, OSError) as e:
        raise ValueError(
            f"{p}: not a readable PCM WAV file ({str(e).splitlines()[0] if str(e) else e!r})"
        ) from None
    if width not in _SAMPLE_DTYPES:
        raise ValueError(f"{p}: {8 * width}-bit samples; expected 8-, 16- or 32-bit PCM")
    if rate <= 0:
        raise ValueError(f"{p}: sample rate {rate} Hz; expected a positive rate")
    count = len(raw) // (width * channels)
    if count == 0:
        raise ValueError(f"{p}: the WAV file holds no samples")
    x = torch.frombuffer(bytearray(raw[: count * width * channels]), dtype=_SAMPLE_DTYPES[width])
    x = x.reshape(count, channels).double()  # [count * channels] -> [count, channels]
    x = (x - 128.0) / 128.0 if width == 1 else x / float(2 ** (8 * width - 1))
    return resample(x.mean(dim=1), rate)


def wav_features(path: str | os.PathLike[str], n_mels: int = 80) -> Tensor:
    """Log-mel features [1, n_mels, 3000] of the first 30 s of a PCM WAV file (resampled to 16 kHz)."""
    return log_mel(read_wav(path), n_mels)[None]  # [n_mels, 3000] -> [1, n_mels, 3000]


__all__ = ["N_SAMPLES", "SAMPLE_RATE", "log_mel", "mel_filters", "read_wav", "resample", "wav_features"]
