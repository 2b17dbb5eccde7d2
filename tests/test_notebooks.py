"""The notebooks in examples/ run from top to bottom, offline, and are stored without outputs.

Each notebook is executed by nbclient in a fresh ipykernel (the interpreter running pytest), with the
working folder a temporary one (so run folders and pictures stay out of the repository), a per-cell
timeout and the Hugging Face libraries told to stay offline (headspace itself reads only installed
files). Any cell error fails the test with the cell's source and traceback.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbclient  # the [dev] extra: nbclient, nbformat, ipykernel
import nbformat
import pytest

pytestmark = pytest.mark.slow  # the whole module (pyproject.toml: -m slow runs it)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # the training cells of 02 take 10-60 s on 2 busy cores; 03 and 04 load SmolLM2 (3-40 s)
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_there_are_notebooks() -> None:
    names = [p.name for p in NOTEBOOKS]
    assert names[:5] == [
        "01_projection_matrices.ipynb",
        "02_heads_specialise.ipynb",
        "03_gqa_and_rope.ipynb",  # SmolLM2: grouped-query attention, rotary positions, rotary_planes
        "04_which_heads_cause_the_answer.ipynb",  # SmolLM2: patching, attribution, the logit lens
        "05_head_atlas.ipynb",  # SmolLM2: every head over a corpus (analysis.atlas, the atlas page)
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean_and_opens_with_what_it_teaches(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "what this teaches" in first.source.lower()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} is stored with outputs; clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count; clear it"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_offline_without_errors(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)  # the kernel inherits this process's environment
    nb = nbformat.read(path, as_version=4)
    examples_before = sorted(p.name for p in EXAMPLES.iterdir())
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",  # ipykernel's own spec: jupyter_client starts it with this interpreter
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working folder
        allow_errors=False,
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError (source + traceback) on the first failing cell
    took = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n{path.name}: {took:.1f} s")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # tqdm.auto without ipywidgets printed "TqdmWarning: IProgress not found" in every notebook
    warned = [o for o in outputs if "IProgress" in str(o.get("text", "")) + str(o.get("data", ""))]
    assert not warned, warned[0]
    assert not (EXAMPLES / "runs").exists(), "a notebook wrote into examples/; it must use its working folder"
    # nor anything else (02 writes runs/, 04 patch_heads.png: into the kernel's working folder, tmp_path)
    assert sorted(p.name for p in EXAMPLES.iterdir()) == examples_before, "a notebook wrote into examples/"
    assert (tmp_path / "runs").is_dir() == (path.stem == "02_heads_specialise")
    assert (tmp_path / "patch_heads.png").is_file() == (path.stem == "04_which_heads_cause_the_answer")
