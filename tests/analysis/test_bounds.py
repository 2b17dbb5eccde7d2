"""Circuit, patch and attribute runs are bounded before they allocate (issue 42).

Held here: prompts past the position table are refused before the model runs, in the words every model
forward (and so ``why``) uses; a run's peak memory is estimated from its shape (an upper bound of the
peak measured in a fresh process, and within a small factor of it) and a run above the limit is refused
naming the estimate and the limit; patching fits its batches of runs under the limit; ``circuit`` on an
encoder says circuits need a decoder; a task line nested 100,000 deep is a one-line error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_circuits import make_model, tiny_gpt2
from torch.testing import assert_close

import headspace as hs
from headspace.analysis import attribution as A
from headspace.analysis import budget as B
from headspace.analysis import circuits as C
from headspace.analysis import patching as P
from headspace.analysis import tasks as T
from headspace.cli import cli

WORDS = "When Mary and John went to the store , John gave a drink to".split()


def ids_task(model: torch.nn.Module, pairs: int, seq: int, name: str = "t") -> T.Task:
    """A task of token ids: ``pairs`` random prompts of ``seq`` tokens, each corrupt one differing at one
    position (no tokenizer needed)."""
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    clean = torch.randint(0, V, (pairs, seq), generator=g)  # (pairs, seq)
    corrupt = clean.clone()
    corrupt[:, seq // 2] = (corrupt[:, seq // 2] + 1) % V
    lengths = torch.full((pairs,), seq)
    answer, other = torch.zeros(pairs, dtype=torch.long), torch.ones(pairs, dtype=torch.long)
    return T.Task(name, clean, corrupt, lengths, answer, other, [("c", "k")] * pairs)


class Counting:
    """A model wrapper (``.model``, ``tokenize_padded`` of space-separated word ids) that counts its
    module's embeddings and forwards: neither may run when a task is refused."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.model, self.calls = module, 0
        for name in ("embed", "forward"):
            fn = getattr(module, name)

            def counted(*args, fn=fn, **kwargs):
                self.calls += 1
                return fn(*args, **kwargs)

            setattr(module, name, counted)

    def tokenize_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [[len(w) % self.model.config.vocab_size for w in t.split()] for t in texts]
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)  # (batch, seq), right-padded
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        lengths = torch.tensor([len(r) for r in rows])
        return tokens, torch.arange(width)[None] < lengths[:, None]  # key padding (batch, seq)


# ----------------------------------------------------------------------------------- prompt lengths
def test_a_task_past_the_position_table_is_refused_before_the_model_runs(tmp_path: Path) -> None:
    module = make_model("llama")  # rotary: nothing in a graph run would notice a position past the table
    limit = module.config.max_seq_len
    wrapped = Counting(module)
    pair = {"clean": "w " * (limit + 1), "corrupt": "x " * (limit + 1), "answer": 0, "other": 1}
    with pytest.raises(ValueError, match=rf"task 't' pair 1 clean prompt has length {limit + 1}, longer than "
                       rf"the position table \(max_seq_len={limit}\); refused, not truncated"):  # fmt: skip
        T.make_task(wrapped, [pair], name="t")
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(pair) + "\n")
    with pytest.raises(ValueError, match=r"pair 1 clean prompt has length 33, longer than the position"):
        T.load_task(wrapped, path)
    # a Task built by hand reaches the graph runs, which call no model forward: refused there
    with pytest.raises(ValueError, match=r"longest prompt of task 'long' has length 40, longer than the"):
        C.edge_scores(wrapped, ids_task(module, 2, 40, "long"), "eap-ig", 2)
    long = ids_task(module, 2, 40, "long")
    with pytest.raises(ValueError, match=r"longer than the position table \(max_seq_len=32\)"):
        C.faithfulness(wrapped, long, C.graph_of(module).valid)
    scores = C.edge_scores(module, ids_task(module, 2, 10), "eap")
    wrapped.calls = 0
    with pytest.raises(ValueError, match=r"longer than the position table \(max_seq_len=32\)"):
        C.faithfulness_curve(wrapped, long, scores)
    assert wrapped.calls == 0
    C.edge_scores(wrapped, ids_task(module, 2, limit, "fits"), "eap", batch_size=2)  # the whole table fits
    assert wrapped.calls > 0


def test_circuit_refuses_a_long_task_in_the_words_why_uses(tmp_path: Path) -> None:
    folder = tiny_gpt2(tmp_path / "gpt2")  # 40 positions, a word-level tokenizer
    long = " ".join((WORDS * 4)[:44])
    runner = CliRunner()
    why = runner.invoke(cli, ["why", "--model", str(folder), long, "--layer", "1", "--head", "0"])
    assert why.exit_code == 2
    task = tmp_path / "long.jsonl"
    task.write_text(json.dumps({"clean": long, "corrupt": long.replace("Mary", "Tom"), "answer": " Mary",
                                "other": " John"}) + "\n")  # fmt: skip
    res = runner.invoke(cli, ["circuit", "--model", str(folder), "--task", str(task), "--out",
                              str(tmp_path / "o")])  # fmt: skip
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    said = "has length 44, longer than the position table (max_seq_len=40); refused, not truncated: truncate"
    assert said in res.output and said in why.output
    assert not (tmp_path / "o").exists()


def test_patch_and_attribute_refuse_prompts_past_the_table_before_a_forward() -> None:
    module = make_model("gpt2")
    wrapped = Counting(module)
    t = ids_task(module, 1, 33)
    for run in (
        lambda: P.patch(wrapped, t.clean, t.corrupt, answer=0, other=1),
        lambda: P.attribution_patching(wrapped, t.clean, t.corrupt, answer=0, other=1),
        lambda: A.direct_logit_attribution(wrapped, t.clean, 0, 1),
        lambda: A.logit_lens(wrapped, t.clean, 0),
    ):
        with pytest.raises(ValueError, match=r"prompt has length 33, longer than the position table"):
            run()
    assert wrapped.calls == 0


# ------------------------------------------------------------------------------------------- memory
MEASURE = r"""
import json, sys
import torch
import headspace as hs
from headspace.analysis import attribution as A, budget as B, circuits as C, patching as P, tasks as T

case, rows, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
cfg = hs.ModelConfig(arch="decoder", vocab_size=500, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2,
    d_head=32, d_mlp=384, max_seq_len=4096, norm_kind="rmsnorm", mlp_kind="gated", act="silu",
    positions="rotary", bias=False)
model = hs.Decoder(cfg).eval()

def task(n, s):
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 500, (n, s), generator=g)
    corrupt = clean.clone()
    corrupt[:, s // 2] = (corrupt[:, s // 2] + 1) % 500
    one = torch.ones(n, dtype=torch.long)
    return T.Task("t", clean, corrupt, torch.full((n,), s), 0 * one, one, [("a", "b")] * n)

def run(n, s):
    t = task(n, s)
    if case == "eap-ig":
        C.edge_scores(model, t, "eap-ig", 2, batch_size=n)
    elif case == "run":
        C.faithfulness(model, t, C.graph_of(model).valid & (torch.rand(C.graph_of(model).valid.shape) < .3),
                       batch_size=n)
    elif case == "patch":
        P.patch(model, t.clean[:1], t.corrupt[:1], site="heads", answer=0, other=1, max_runs=n)
    elif case == "attribution_patching":
        P.attribution_patching(model, t.clean[:1], t.corrupt[:1], site="heads", answer=0, other=1)
    else:
        A.direct_logit_attribution(model, t.clean, 0, 1)

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

run(1, 8)  # the code and its one-time tables loaded
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS (VmHWM) reset to the RSS now
before = status("VmRSS")
run(rows, seq)
peak = status("VmHWM") - before
m = B.shape_of(model)
estimate = {
    "eap-ig": lambda: B.circuit_bytes(m, rows, seq, "eap-ig"),
    "run": lambda: B.circuit_bytes(m, rows, seq, "run"),
    "patch": lambda: B.patch_bytes(m, min(rows, 12), seq, seq - seq // 2),
    "attribution_patching": lambda: B.patch_bytes(m, 1, seq, seq, grad=True),
    "dla": lambda: B.attribution_bytes(m, rows, seq, "dla"),
}[case]()
print(json.dumps({"peak": peak, "estimate": estimate}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak RSS")
@pytest.mark.parametrize(
    "case, rows, seq",
    [
        ("eap-ig", 4, 256),
        ("run", 8, 256),
        ("patch", 12, 512),
        ("attribution_patching", 1, 512),
        ("dla", 2, 1024),
    ],
)
def test_the_estimate_bounds_the_measured_peak(case: str, rows: int, seq: int) -> None:
    """In a fresh process: the peak RSS over a run (/proc/self/status VmHWM, reset before it; getrusage's
    ru_maxrss would carry pytest's own peak over the exec) less the RSS before it, with glibc's mmap
    threshold fixed (freed blocks go back to the system, so RSS follows what is held), is at most the
    estimate, and the estimate at most 4 times it (a bound, not a guess far above)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(hs.__file__).parents[1])}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, case, str(rows), str(seq)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    peak, estimate = got["peak"], got["estimate"]
    assert peak > 8 << 20, got  # the run is large enough that its peak is measurable
    assert peak <= estimate <= 4 * peak, got


def test_a_run_above_the_limit_is_refused_naming_estimate_and_limit(monkeypatch) -> None:
    module = make_model("llama")
    wrapped = Counting(module)
    task = ids_task(module, 4, 20)
    with pytest.raises(B.MemoryBudgetError) as e:
        C.edge_scores(wrapped, task, "eap-ig", 3, max_memory="100K")
    message = str(e.value)
    estimate = B.circuit_bytes(B.shape_of(module), 4, 20, "eap-ig")
    assert f"eap-ig edge scores needs an estimated {B.format_bytes(estimate)} at its peak" in message
    assert "4 pairs of 20 tokens a pass" in message
    assert "more than the limit of 100.0 KiB (max_memory=100K)" in message and "\n" not in message
    monkeypatch.setenv("HEADSPACE_MAX_MEMORY", "50000")
    with pytest.raises(B.MemoryBudgetError, match=r"limit of 48.8 KiB \(HEADSPACE_MAX_MEMORY=50000\)"):
        C.faithfulness(wrapped, task, C.graph_of(module).valid)
    scores = C.edge_scores(module, task, "eap", max_memory="1G")
    wrapped.calls = 0
    with pytest.raises(B.MemoryBudgetError, match=r"a circuit run needs an estimated .* limit of 48.8 KiB"):
        C.faithfulness_curve(wrapped, task, scores)
    t = ids_task(module, 1, 20)
    for run, what in (
        (lambda: P.patch(wrapped, t.clean, t.corrupt, answer=0, other=1), "activation patching"),
        (
            lambda: P.attribution_patching(wrapped, t.clean, t.corrupt, answer=0, other=1),
            "attribution patching",
        ),
        (lambda: A.direct_logit_attribution(wrapped, t.clean, 0, 1), "direct logit attribution"),
        (lambda: A.logit_lens(wrapped, t.clean, 0), "the logit lens"),
    ):
        with pytest.raises(
            B.MemoryBudgetError, match=rf"^{what} needs an estimated .* KiB .*limit of 48.8 KiB"
        ):
            run()
    assert wrapped.calls == 0
    monkeypatch.delenv("HEADSPACE_MAX_MEMORY")
    with pytest.raises(ValueError, match=r"max_memory must be a memory size: .* got '8Q'"):
        C.edge_scores(module, task, "eap", max_memory="8Q")


def test_patching_fits_its_batches_under_the_limit() -> None:
    """Under a limit that one batch of every run would pass, the sweep runs in smaller batches: the same
    effects; a limit below one run is refused."""
    module = make_model("llama")
    t = ids_task(module, 1, 24)
    m = B.shape_of(module)
    whole = P.patch(module, t.clean, t.corrupt, site="heads_pos", answer=0, other=1, max_memory="1G")
    n_runs = 3 * 4 * (24 - 12)
    limit = B.patch_bytes(m, n_runs // 5, 24, 12)
    assert limit < B.patch_bytes(m, n_runs, 24, 12)
    assert B.fit_runs(m, n_runs, 24, 12, limit) <= n_runs // 5
    part = P.patch(module, t.clean, t.corrupt, site="heads_pos", answer=0, other=1, max_memory=limit)
    assert_close(part.patched_metric, whole.patched_metric)
    with pytest.raises(B.MemoryBudgetError, match=r"1 patched run of 24 tokens a batch"):
        P.patch(module, t.clean, t.corrupt, site="heads_pos", answer=0, other=1, max_memory=1000)


def test_memory_sizes_and_the_default_limit(monkeypatch) -> None:
    assert B.parse_memory("8G") == 8 << 30 and B.parse_memory("512m") == 512 << 20
    assert B.parse_memory("1.5GiB") == 3 << 29 and B.parse_memory(1000) == 1000 == B.parse_memory("1000")
    for bad in ("", "8Q", "-1", "0", 0, 1.5, None, True):
        with pytest.raises(ValueError, match="max_memory must be"):
            B.parse_memory(bad)
    monkeypatch.delenv("HEADSPACE_MAX_MEMORY", raising=False)
    limit, source = B.memory_limit()
    assert "MemAvailable" in source and (limit is None or limit > 0)


def test_cli_max_memory_refuses_in_one_line(tmp_path: Path) -> None:
    folder = tiny_gpt2(tmp_path / "gpt2")
    runner = CliRunner()
    for args in (
        ["patch", "--max-memory", "2K"],
        ["attribute", "When Mary and John went to the store", "--answer", " Mary", "--max-memory", "2K"],
        ["circuit", "--pairs", "2", "--out", str(tmp_path / "o"), "--max-memory", "2K"],
    ):
        res = runner.invoke(cli, [*args, "--model", str(folder)])
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
        assert (
            "needs an estimated" in res.output
            and "more than the limit of 2.0 KiB (max_memory=2K)" in res.output
        )
    res = runner.invoke(cli, ["patch", "--model", str(folder), "--max-memory", "lots"])
    assert res.exit_code == 2 and "--max-memory must be a memory size" in res.output


# ------------------------------------------------------------------------------------ odd inputs
def test_circuit_on_an_encoder_says_circuits_need_a_decoder(tmp_path: Path, monkeypatch) -> None:
    import headspace.cli.circuits as cli_circuits

    monkeypatch.setattr(cli_circuits, "load_model", lambda spec: hs.load("minilm"))
    res = CliRunner().invoke(cli, ["circuit", "--model", "minilm", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert (
        "circuits read logits, so they need a decoder" in res.output
        and "this model is an encoder" in res.output
    )
    assert "name" not in res.output


def test_a_task_line_nested_100000_deep_is_one_line_naming_file_and_line(tmp_path: Path) -> None:
    module = make_model("gpt2")
    path = tmp_path / "deep.jsonl"
    good = json.dumps({"clean": "a b", "corrupt": "a c", "answer": 0, "other": 1})
    path.write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(
        ValueError, match=rf"^task file '{path}' line 2 is not one JSON object .* nests too deeply"
    ):
        T.load_task(Counting(module), path)
