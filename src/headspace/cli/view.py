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
from typing import Any

import click

from ..core.defaults import default_sentence
from ..core.errors import UsageError
from .loader import at_precision, load_model
from .options import TOKENS_HELP, choice_option, model_choice_option, model_precision_option
from .output import check_writable_folder

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
    views: list[Any] = []
    if result_files:  # read first: a bad file is known before any model is loaded
        from ..viz.explorer.results import load_results, prompt_of

        for name in result_files:
            try:
                views += load_results(name)
            except (OSError, ValueError) as e:
                raise UsageError(f"--result: {' '.join(str(e).split())}") from None
        if sentence is None:
            sentence = prompt_of(views)
    if sentence is not None and not sentence.strip():
        raise UsageError("SENTENCE is empty; give at least one word (or leave it out for the default)")
    if output is not None:
        folder = Path(output).parent
        if not folder.is_dir():
            raise UsageError(f"-o {output!r}: the folder {str(folder)!r} does not exist")
        check_writable_folder(folder, "-o", output)
    from ..viz.explorer.page import Explorer, page_server

    server = None
    if serve:  # bind first: a port in use is known before the model is loaded and the page built
        try:
            server = page_server(port=port)
        except OSError as e:
            raise UsageError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({e.strerror})") from None
    temp: Path | None = None
    with _sigterm_exits():
        try:
            pre = at_precision(load_model(model_name), model_precision)
            if sentence is None:  # the lesson's sentence: an encoder's or a decoder's
                sentence = default_sentence(pre)
            loaded = time.perf_counter()
            try:
                page = Explorer(pre, sentence, precision=precision, results=views)
            except ValueError as e:
                raise UsageError(str(e).splitlines()[0]) from None
            if output is not None:
                path = page.save(output)
            else:
                temp = Path(tempfile.mkdtemp(prefix="headspace-view-"))
                path = page.save(temp / "explorer.html")
            done = time.perf_counter()
            n_tokens = len(page.data["tokens"])
            size_mb = path.stat().st_size / 1e6
            click.echo(
                f"wrote {path} ({size_mb:.1f} MB, {n_tokens} tokens, {len(page.data['layers'])} layers, "
                f"{page.data['precision']}) in {done - start:.1f} s "
                f"(load {loaded - start:.1f} s, build {done - loaded:.1f} s)"
            )
            if views:
                names = ", ".join(v["name"] for v in views)
                click.echo(f"with {len(views)} saved result view(s): {names}")
            if server is not None:
                server.set_page(path)
                host, bound = server.server_address[:2]
                note = "" if temp is None else "; the page is removed when the server stops"
                click.echo(f"serving on http://{host}:{bound}/ (Ctrl-C to stop{note})")
                try:
                    server.serve_forever()
                except KeyboardInterrupt:
                    pass
        finally:
            if server is not None:
                server.server_close()
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)


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
