"""ctranslate2's Whisper in a process of its own, for ``benchmarks/whisper.py``.

Run in the same process as torch, ctranslate2 brings its own OpenMP runtime, and after its first call
every torch system in that process ran about 40% slower on a 2-core machine (two thread pools on the
same cores). So the benchmark starts this child once; it loads the model at float32 and int8, then
answers one request per line on stdin, ``COMPUTE FEATURES.npy``, with the greedy tokens as one JSON
line on stdout.

    python benchmarks/whisper_ct2_child.py CT2_FOLDER PROMPT_JSON MAX_LENGTH
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    import ctranslate2

    folder, prompt, max_length = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    models = {
        c: ctranslate2.models.Whisper(folder, device="cpu", compute_type=c) for c in ("float32", "int8")
    }
    print("ready", flush=True)
    for line in sys.stdin:
        compute, path = line.split(maxsplit=1)
        features = np.load(path.strip(), allow_pickle=False)  # [1, 80, 3000]
        x = ctranslate2.StorageView.from_array(features)
        r = models[compute].generate(x, [prompt], beam_size=1, suppress_blank=False, suppress_tokens=[],
                                     max_length=max_length)  # fmt: skip
        print(json.dumps(list(r[0].sequences_ids[0])), flush=True)


if __name__ == "__main__":
    main()
