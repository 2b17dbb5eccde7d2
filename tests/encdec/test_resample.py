"""WAV files at any sample rate, resampled to 16 kHz by scipy (issue #40), and unreadable or empty files
refused in one line naming the file."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.signal import resample_poly

from headspace.pretrained.encdec.features import SAMPLE_RATE, read_wav, resample, wav_features


def _write(path: Path, samples: np.ndarray, rate: int, channels: int = 1) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return path


def _tone(rate: int, hz: float, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return np.round(16000 * np.sin(2 * np.pi * hz * t))


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_any_rate_is_resampled_to_16_khz(tmp_path: Path, rate: int) -> None:
    pcm = _tone(rate, 440.0)
    x = read_wav(_write(tmp_path / "tone.wav", pcm, rate))
    want = resample_poly(pcm / 32768.0, SAMPLE_RATE, rate)  # scipy itself, reduced ratio or not
    assert x.dtype == torch.float32 and x.shape[0] == want.shape[0] == -(-len(pcm) * SAMPLE_RATE // rate)
    assert np.abs(x.numpy() - want).max() < 1e-6
    spectrum = np.abs(np.fft.rfft(x.numpy()))  # the tone is still at 440 Hz after resampling
    assert abs(np.argmax(spectrum) * SAMPLE_RATE / x.shape[0] - 440.0) < 2.0


def test_stereo_is_averaged_then_resampled(tmp_path: Path) -> None:
    left, right = _tone(22050, 300.0), _tone(22050, 500.0)
    stereo = np.stack([left, right], axis=1).reshape(-1)  # [n, 2] -> [2 n] interleaved frames
    x = read_wav(_write(tmp_path / "stereo.wav", stereo, 22050, channels=2))
    want = resample_poly((left + right) / 2 / 32768.0, 320, 441)
    assert np.abs(x.numpy() - want).max() < 1e-6


def test_features_of_a_resampled_file_equal_the_16_khz_file(tmp_path: Path) -> None:
    pcm = _tone(32000, 1000.0)
    down = np.round(resample_poly(pcm, 1, 2))  # what the reader must compute, saved at 16 kHz
    fast = wav_features(_write(tmp_path / "fast.wav", pcm, 32000))
    slow = wav_features(_write(tmp_path / "slow.wav", down, 16000))
    assert fast.shape == slow.shape == (1, 80, 3000)
    assert (fast - slow).abs().max() < 1e-3  # the rounding of `down` to 16-bit only


def test_resample_keeps_16_khz_samples() -> None:
    x = torch.randn(100, dtype=torch.float64)
    assert torch.equal(resample(x, SAMPLE_RATE), x.float())


def test_unreadable_and_empty_files_are_refused_in_one_line(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    empty = _write(tmp_path / "empty.wav", np.zeros(0), 22050)
    for path, message in [(garbage, "not a readable PCM WAV file"), (empty, "holds no samples")]:
        with pytest.raises(ValueError, match=message) as e:
            read_wav(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value)
