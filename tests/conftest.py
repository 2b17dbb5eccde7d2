"""Shared fixtures: every test starts from the same random state, so a failure reproduces; the session
leaves nothing behind, in the temporary folder or in the repository."""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# ------------------------------------------------------------------------------------ nothing left behind
# Every temporary file of the session, this process's and its children's (torchrun's agent and ranks,
# notebook kernels, compilers), goes into one fresh folder: TMPDIR (TEMP, TMP) points there before any
# test asks for a temporary file, and the folder is removed at exit. Other sessions on the same machine
# have folders of their own, so what is left in it at the end was left by this session's tests. pytest's
# own tmp_path folders are kept only for failed tests, of the last session only (pyproject.toml,
# tmp_path_retention_policy / _count; without them one run kept 375 MB).
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
SESSION_TMP = Path(tempfile.mkdtemp(prefix="headspace-tests-"))
for _name in ("TMPDIR", "TEMP", "TMP"):
    os.environ[_name] = str(SESSION_TMP)
tempfile.tempdir = str(SESSION_TMP)
atexit.register(shutil.rmtree, SESSION_TMP, ignore_errors=True)
REPO = Path(__file__).resolve().parent.parent

# ONNX Runtime (benchmarks/encode.py's rows, tests/bench) sends telemetry from Linux too: loading it writes
# a device id and an event store into $XDG_CACHE_HOME, else ~/.cache, under Microsoft/DeveloperTools/
# .onnxruntime/. ORT_DISABLE_TELEMETRY=1, which its telemetry reads when it starts, turns that off for this
# process and every child (the tests never touch $HOME: tests/test_leaves_nothing.py).
os.environ["ORT_DISABLE_TELEMETRY"] = "1"

# The native decoding step (headspace.kernels.native) is built into a cache folder: a fresh one for each
# test session, so that the suite compiles it as a new machine would and writes nothing under $HOME.
if "HEADSPACE_CACHE" not in os.environ:
    os.environ["HEADSPACE_CACHE"] = tempfile.mkdtemp(prefix="headspace-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HEADSPACE_CACHE"], ignore_errors=True)


#: a C/C++ compiler's temporary file (gcc's ccXXXXXX.s ...): one still running when the session ends
_COMPILER_TEMPORARY = re.compile(r"cc[A-Za-z0-9]{6}\.[a-z]+")


def _kept_until_exit(entry: Path) -> bool:
    """What may stay in SESSION_TMP until its removal at exit: this session's caches (the native step's
    build cache, above; torch.compile's inductor cache), the temporaries of a compiler still at work
    (the native step's background build outlives a short-lived process that started it: a rank, a
    notebook kernel) and hidden files, which tempfile never names and which tools outside the project
    have been seen to write into $TMPDIR (a ``.ses``)."""
    return (
        str(entry) == os.environ["HEADSPACE_CACHE"]
        or entry.name.startswith(("torchinductor_", "."))
        or _COMPILER_TEMPORARY.fullmatch(entry.name) is not None
    )


def _untracked_files() -> set[str] | None:
    """The repository's untracked, not ignored files (``git status``); None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "-z"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {entry[3:] for entry in done.stdout.split("\0") if entry.startswith("?? ")}


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_behind() -> Iterator[None]:
    """At the end of the session: an error naming whatever the tests left in the session's temporary
    folder or as new untracked files in the repository (fix the source: a test or script that writes into
    the current folder, or creates a temporary folder and does not remove it)."""
    untracked = _untracked_files()
    yield
    problems = []
    left = sorted(p.name for p in SESSION_TMP.iterdir() if not _kept_until_exit(p))
    if left:
        problems.append(f"left in the temporary folder ({SESSION_TMP}): {', '.join(left)}")
    if untracked is not None:
        new = sorted((_untracked_files() or set()) - untracked)
        if new:
            problems.append(f"new untracked files in the repository ({REPO}): {', '.join(new)}")
    if problems:
        pytest.fail("the test session left files behind:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed Python, NumPy and torch before each test."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _same_threads() -> Iterator[None]:
    """Each test starts with the session's intra-op thread count: a benchmark's ``--threads 1`` (which
    sets the main thread's count only) must not leave the main thread computing with another count
    than the threads a later test starts (MKL's sums, and so the bits, depend on it)."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture
def automatic_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of the automatic choices themselves (native step, prepack): no fallback forced by the
    environment (CI's emulated pass sets HEADSPACE_FORCE_FALLBACK=all for every other test)."""
    monkeypatch.delenv("HEADSPACE_FORCE_FALLBACK", raising=False)


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Run a module's tests on one intra-op thread, then restore the previous count.

    For modules of many tiny-tensor tests: there, thread hand-off costs more than the work itself, and on
    a shared 2-core machine it made such a module about ten times slower. Opt in with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- SmolLM2
# transformers' own GGUF loading of the bundled SmolLM2 is the reference of several test files; it takes
# tens of seconds, so it is loaded once per session here.
@pytest.fixture(scope="session")
def smollm2_gguf():
    from headspace.pretrained.gguf_format import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(smollm2_gguf.parent),
        gguf_file=smollm2_gguf.name,
        dtype=torch.float32,
        attn_implementation="eager",
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """headspace.load("smollm2"), once per session."""
    import headspace

    return headspace.load("smollm2")


# ---------------------------------------------------------------------------------------------- Gemma 3
# Gemma-3-270M ships as four chunks (tests/pretrained/test_gemma3.py); transformers reads one file, so the
# reference gets the chunks concatenated into a session temporary folder (removed at the session's end).
@pytest.fixture(scope="session")
def gemma3_parts():
    """The chunks and digest of Gemma-3-270M. The README's test command installs its five packages, so a
    missing one fails here (with the install command), never skips: these tests are the only check of
    the GGUF reader on a real Gemma file."""
    from headspace.pretrained.gguf import gemma3_gguf_parts

    return gemma3_gguf_parts()


@pytest.fixture(scope="session")
def gemma3_file(gemma3_parts):
    from headspace.pretrained.gguf import assemble_gemma3_gguf

    folder = Path(tempfile.mkdtemp(prefix="gemma3-"))
    path = assemble_gemma3_gguf(folder)
    yield path
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_file):
    import transformers  # a dev dependency: imported, not skipped

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    model = transformers.Gemma3ForCausalLM.from_pretrained(
        str(gemma3_file.parent), gguf_file=gemma3_file.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_file):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(gemma3_file.parent), gguf_file=gemma3_file.name)


@pytest.fixture(scope="session")
def gemma3(gemma3_parts):
    """headspace.load("gemma3"), once per session."""
    import headspace

    return headspace.load("gemma3")
