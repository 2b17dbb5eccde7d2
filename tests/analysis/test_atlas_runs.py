"""The head atlas as a run: resumed after SIGKILL, on two torch.distributed ranks, from the command line.

The resume and two-rank tests run a small worker script (a random decoder, a token corpus) in fresh
interpreters on one thread each, so that every run does the same float operations: the killed-and-
restarted run and the two-rank run must write an ``atlas.json`` byte for byte equal to the one of an
uninterrupted single process. The command-line test runs ``headspace atlas`` on SmolLM2 and MiniLM
with a short corpus, checks the numbers against the per-prompt functions and the page for injection.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.testing import assert_close

import headspace as hs
from headspace.analysis import atlas, head_roles
from headspace.analysis.attribution import direct_logit_attribution
from headspace.cli import cli

WORKER = r"""
import os, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
import headspace as hs
import importlib
A = importlib.import_module("headspace.analysis.atlas.run")  # the module (the package exports the function)
from headspace.process_group import setup_distributed, teardown

out = Path(sys.argv[1])
delay = float(os.environ.get("ATLAS_TEST_DELAY", "0"))
computed = []
measure = A.measure_batch

def slow_measure(*args, **kwargs):
    computed.append(1)
    time.sleep(delay)
    return measure(*args, **kwargs)

A.measure_batch = slow_measure
torch.manual_seed(0)
cfg = hs.ModelConfig(arch="decoder", vocab_size=23, d_model=30, n_layers=3, n_heads=5, d_mlp=44,
                     max_seq_len=32, dropout=0.0, attn_dropout=0.0, emb_dropout=0.0)
model = hs.Decoder(cfg).eval()
g = torch.Generator().manual_seed(3)
docs = [torch.randint(0, 23, (n,), generator=g) for n in (20, 5, 11, 2, 17, 9)]
info = setup_distributed("cpu", timeout_s=120)
res = A.atlas(model, docs, window=12, batch_size=2, shard_size=1, top_k=3, out=out, dist_info=info,
              progress=False, induction_repeated=False)
if info.is_main:
    res.to_json(out / "atlas.json")
print(f"computed {len(computed)}", flush=True)  # one write: ranks share stdout
teardown(info)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    src = str(Path(hs.__file__).resolve().parents[1])
    env.update(PYTHONPATH=src, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **extra)
    return env


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("worker") / "atlas_worker.py"
    path.write_text(WORKER)
    return path


@pytest.fixture(scope="module")
def reference(worker: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """atlas.json of one uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("single")
    done = subprocess.run([sys.executable, str(worker), str(out)], env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "computed 8" in done.stdout  # 8 windows, one shard and one batch each
    return (out / "atlas.json").read_bytes()


@pytest.mark.slow
def test_sigkill_then_resume_writes_the_same_atlas(worker: Path, reference: bytes, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(tmp_path)], env=_env(ATLAS_TEST_DELAY="0.5"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    shards = tmp_path / "shards"
    deadline = time.monotonic() + 120
    while not (shards.is_dir() and len(list(shards.glob("stats-*.json"))) >= 2):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "no shard sealed within 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sealed = len(list(shards.glob("stats-*.json")))
    assert 2 <= sealed < 8 and not (tmp_path / "atlas.json").exists()
    done = subprocess.run(
        [sys.executable, str(worker), str(tmp_path)], env=_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert f"computed {8 - sealed}" in done.stdout  # the sealed shards were not measured again
    assert (tmp_path / "atlas.json").read_bytes() == reference


def test_a_shard_of_another_run_is_refused(tmp_path: Path) -> None:
    model = hs.Decoder(hs.ModelConfig(arch="decoder", vocab_size=23, d_model=30, n_layers=3, n_heads=5))
    docs = [torch.arange(10) % 23]
    atlas(model.eval(), docs, window=8, out=tmp_path, progress=False, induction_repeated=False)
    with pytest.raises(ValueError, match="a shard of another run"):
        atlas(model, docs, window=6, out=tmp_path, progress=False, induction_repeated=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_merge_to_the_single_process_atlas(worker: Path, reference: bytes, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), str(worker), str(tmp_path),
    ]  # fmt: skip
    scratch = tmp_path / "tmp"  # torchrun's own temporary folder, removed with tmp_path
    scratch.mkdir()
    out = tmp_path / "out"
    cmd[-1] = str(out)
    done = subprocess.run(cmd, env=_env(TMPDIR=str(scratch)), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("computed 4") == 2  # 4 shards each
    assert (out / "atlas.json").read_bytes() == reference


TEXTS = ["The cat sat on the mat. The cat sat", "</script><script>alert(1)</script> Paris is in France."]


def _windows(model, texts: list[str], window: int) -> list[torch.Tensor]:
    out = []
    for t in texts:
        ids = model.tokenize_padded([t])[0][0]
        out += [ids[s : s + window] for s in range(0, ids.shape[0], window)]
    return out


@pytest.mark.slow
def test_cli_on_minilm(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "atlas"
    args = ["atlas", "--model", "minilm", "--corpus", str(corpus), "--out", str(out), "--window", "9"]
    result = CliRunner().invoke(cli, [*args, "--top-k", "2", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "6 layers x 12 heads" in result.output
    d = json.loads((out / "atlas.json").read_text())
    minilm = hs.load("minilm")
    seqs = _windows(minilm, TEXTS, 9)
    n = sum(s.shape[0] for s in seqs)
    assert d["n_tokens"] == n and d["n_sequences"] == len(seqs)
    roles = [(head_roles(minilm, s[None], chunk_size=None), s.shape[0]) for s in seqs]
    for key, field in (("entropy", "entropy"), ("self", "current")):
        want = sum(getattr(r, field).double() * k for r, k in roles) / n
        assert_close(torch.tensor(d[key], dtype=torch.float64), want, atol=5e-6, rtol=1e-4)
    assert d["direct_effect"][0][0] is None  # an encoder: no logits
    page = (out / "atlas.html").read_text()
    data = page.split('<script type="application/json" id="atlas-data">')[1].split("</script>")[0]
    assert "alert" in data and "<" not in data and "\\u003c" in data  # the tokens are data, '<' escaped
    assert "http://" not in page and "https://" not in page
    bad = CliRunner().invoke(cli, ["atlas", "--corpus", str(tmp_path / "none.txt"), "--out", str(out)])
    assert bad.exit_code == 2 and "no such file or folder" in bad.output


@pytest.mark.slow
def test_smollm2_matches_per_prompt_functions() -> None:
    smollm2 = hs.load("smollm2")
    text = ["The cat sat on the mat. The cat sat"]
    result = atlas(smollm2, text, window=8, ablation=False, progress=False, induction_repeated=False)
    seqs = _windows(smollm2, text, 8)
    prev = sum(
        head_roles(smollm2, s[None], chunk_size=None).previous.double() * (s.shape[0] - 1) for s in seqs
    )
    assert_close(result.stats["previous"], prev / sum(s.shape[0] - 1 for s in seqs), atol=5e-6, rtol=1e-4)
    de = sum(
        direct_logit_attribution(smollm2, s[: i + 1][None], int(s[i + 1])).heads.double()
        for s in seqs
        for i in range(s.shape[0] - 1)
    )
    assert_close(result.stats["direct_effect"], de / sum(s.shape[0] - 1 for s in seqs), atol=1e-4, rtol=1e-3)
