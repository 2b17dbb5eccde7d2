"""Shared fixtures: every test starts from the same random state, so a failure reproduces."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
import torch

# The native decoding step (headspace.kernels.native) is built into a cache folder: a fresh one for each
# test session, so that the suite compiles it as a new machine would and writes nothing under $HOME.
if "HEADSPACE_CACHE" not in os.environ:
    os.environ["HEADSPACE_CACHE"] = tempfile.mkdtemp(prefix="headspace-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HEADSPACE_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed Python, NumPy and torch before each test."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


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
