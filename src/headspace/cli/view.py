"""``headspace view``: write the explorer page for a sentence (and optionally serve it on localhost).

``--result FILE`` (repeatable) adds saved patching / attribution results to the page as heatmaps: the JSON
of ``PatchResult.to_json(path)``, ``LogitAttribution.to_json(path)``, ``LogitLens.to_json(path)``, or of
``headspace patch --json`` / ``headspace attribute --json``. Without SENTENCE the page opens on the
result's clean prompt.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..core.defaults import default_sentence
from ..core.errors import UsageError
from .errors import check_input, reported
from .loader import at_precision, load_model
from .options import TOKENS_HELP, choice_option, model_choice_option, model_precision_option
from .output import check_writable_folder, output_folder

if TYPE_CHECKING:  # the page module imports torch; --help must not
    from ..viz.explorer.page import Explorer, PageServer

#: --precision choices (:data:`headspace.viz.explorer.data.PRECISIONS`, kept here so --help needs no torch).
PRECISIONS = ("auto", "float32", "float16")


@click.command("view", epilog=TOKENS_HELP)
@click.argument("sentence", required=False)
@model_choice_option("minilm", dest="model_name")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="the HTML file to write (one self-contained page)",
)
@click.option("--serve", is_flag=True, help="serve the page on http://127.0.0.1:PORT until Ctrl-C")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@choice_option(
    "--precision",
    choices=PRECISIONS,
    default="auto",
    help="stored numbers: float32 (exact) or float16 (half the size); auto = float32 up to 128 tokens",
)
@model_precision_option
@click.option(
    "--result",
    "result_files",
    multiple=True,
    metavar="FILE",
    help="a saved patching or attribution result (to_json(path), or headspace patch/attribute --json) "
    "to show as a heatmap; repeat for several. Without SENTENCE the page opens on its prompt",
)
def view(
    sentence: str | None,
    model_name: str,
    output: str | None,
    serve: bool,
    port: int,
    precision: str,
    model_precision: str,
    result_files: tuple[str, ...],
) -> None:
    """Write the explorer page for SENTENCE: every head's attention, the q-k-v-softmax-W_O pipeline of
    one head for one token, subspace overlaps and W_O's shares, from the real model. No network."""
    start = time.perf_counter()  # what the user waits for: imports and the model load included
    if output is None and not serve:
        raise UsageError("say where the page goes: -o FILE.html (and/or --serve to open it on localhost)")
    views, sentence = _read_results(result_files, sentence)  # a bad file is known before any model load
    _check_sentence_and_output(sentence, output)
    server = _bind(port) if serve else None  # a port in use is known before the model is loaded
    temp: Path | None = None
    with _sigterm_exits():
        try:
            pre = at_precision(load_model(model_name), model_precision)
            if sentence is None:  # the lesson's sentence: an encoder's or a decoder's
                sentence = default_sentence(pre)
            loaded = time.perf_counter()
            page = _build_page(pre, sentence, precision, views)
            path, temp = _save_page(page, output)
            _report(page, path, views, start, loaded, time.perf_counter())
            if server is not None:
                _serve(server, path, removed_after=temp is not None)
        finally:
            if server is not None:
                server.server_close()
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)


def _read_results(result_files: tuple[str, ...], sentence: str | None) -> tuple[list[Any], str | None]:
    """The heatmap views of every ``--result`` file, in order, and the sentence the page opens on: the
    given one, else (with results) the results' clean prompt. A file that cannot be read or parsed is a
    :class:`UsageError` naming ``--result`` and the file's problem on one line."""
    if not result_files:
        return [], sentence
    from ..viz.explorer.results import load_results, prompt_of

    views: list[Any] = []
    for name in result_files:
        check_input(name, "--result", "result file")
        with reported("--result"):
            views += load_results(name)
    return views, prompt_of(views) if sentence is None else sentence


def _check_sentence_and_output(sentence: str | None, output: str | None) -> None:
    """Refuse an all-blank SENTENCE, and an ``-o`` whose folder cannot be written or created (a new
    folder is made only inside an existing one, as for every command's output folder)."""
    if sentence is not None and not sentence.strip():
        raise UsageError("SENTENCE is empty; give at least one word (or leave it out for the default)")
    if output is not None:
        check_writable_folder(Path(output).parent, "-o", output)


def _bind(port: int) -> PageServer:
    """The page server bound to 127.0.0.1:``port`` (0: any free port), not yet serving; a port that
    cannot be listened on is a :class:`UsageError` naming it and the OS's reason."""
    from ..viz.explorer.page import page_server

    with reported(f"--port {port}: cannot listen on 127.0.0.1:{port}", in_brackets=True):
        return page_server(port=port)


def _build_page(pre: Any, sentence: str, precision: str, views: list[Any]) -> Explorer:
    """The :class:`~headspace.viz.explorer.page.Explorer` of ``sentence`` on the loaded model ``pre``;
    a sentence or precision it refuses is one line (:func:`.errors.reported`)."""
    from ..viz.explorer.page import Explorer

    return Explorer(pre, sentence, precision=precision, results=views)


def _save_page(page: Explorer, output: str | None) -> tuple[Path, Path | None]:
    """Save ``page`` to ``output``, or (None: only served) into a fresh temporary folder; returns
    (the page's path, that folder or None). The folder is removed again if the save fails."""
    if output is not None:
        output_folder(Path(output).parent)
        return page.save(output), None
    temp = Path(tempfile.mkdtemp(prefix="headspace-view-"))
    try:
        return page.save(temp / "explorer.html"), temp
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _report(page: Explorer, path: Path, views: list[Any], start: float, loaded: float, done: float) -> None:
    """Echo what was written: the path, its size, tokens, layers and stored precision, the wall time
    from ``start`` split at ``loaded`` into model load and page build, and the saved result views."""
    size_mb = path.stat().st_size / 1e6
    click.echo(
        f"wrote {path} ({size_mb:.1f} MB, {len(page.data['tokens'])} tokens, {len(page.data['layers'])} "
        f"layers, {page.data['precision']}) in {done - start:.1f} s "
        f"(load {loaded - start:.1f} s, build {done - loaded:.1f} s)"
    )
    if views:
        names = ", ".join(v["name"] for v in views)
        click.echo(f"with {len(views)} saved result view(s): {names}")


def _serve(server: PageServer, path: Path, removed_after: bool) -> None:
    """Serve ``path`` on the bound ``server`` until Ctrl-C (which ends it quietly); the caller closes
    the server. ``removed_after`` says, in the banner, that the page goes when the server stops."""
    server.set_page(path)
    host, bound = server.server_address[:2]
    note = "; the page is removed when the server stops" if removed_after else ""
    click.echo(f"serving on http://{host}:{bound}/ (Ctrl-C to stop{note})")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit (143), so ``finally`` blocks run (the temp page goes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)
