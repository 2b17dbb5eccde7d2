"""``headspace view``: write the explorer page for a sentence (and optionally serve it on localhost)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click

from ..defaults import DEFAULT_SENTENCE
from ..errors import UsageError
from .loader import load_model

#: --precision choices (:data:`headspace.viz.explorer.data.PRECISIONS`, kept here so --help needs no torch).
PRECISIONS = ("auto", "float32", "float16")


@click.command("view")
@click.argument("sentence", required=False)
@click.option(
    "--model",
    "model_name",
    default="minilm",
    show_default=True,
    help="'minilm' (bundled all-MiniLM-L6-v2) or a folder with a Hugging Face checkpoint",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="the HTML file to write (one self-contained page)",
)
@click.option("--serve", is_flag=True, help="serve the page on http://127.0.0.1:PORT until Ctrl-C")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default="auto",
    show_default=True,
    help="stored numbers: float32 (exact) or float16 (half the size); auto = float32 up to 128 tokens",
)
def view(
    sentence: str | None, model_name: str, output: str | None, serve: bool, port: int, precision: str
) -> None:
    """Write the explorer page for SENTENCE: every head's attention, the q-k-v-softmax-W_O pipeline of
    one head for one token, subspace overlaps and W_O's shares, from the real model. No network."""
    from ..viz.explorer.page import Explorer, serve_page

    if output is None and not serve:
        raise UsageError("say where the page goes: -o FILE.html (and/or --serve to open it on localhost)")
    if sentence is None:
        sentence = DEFAULT_SENTENCE
    if not sentence.strip():
        raise UsageError("SENTENCE is empty; give at least one word (or leave it out for the default)")
    if output is not None:
        folder = Path(output).parent
        if not folder.is_dir():
            raise UsageError(f"-o {output!r}: the folder {str(folder)!r} does not exist")
    pre = load_model(model_name)
    start = time.perf_counter()
    try:
        page = Explorer(pre, sentence, precision=precision)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    if output is not None:
        path = page.save(output)
    else:
        path = page.save(Path(tempfile.mkdtemp(prefix="headspace-view-")) / "explorer.html")
    n_tokens = len(page.data["tokens"])
    size_mb = path.stat().st_size / 1e6
    click.echo(
        f"wrote {path} ({size_mb:.1f} MB, {n_tokens} tokens, {len(page.data['layers'])} layers, "
        f"{page.data['precision']}) in {time.perf_counter() - start:.1f} s"
    )
    if serve:
        try:
            server = serve_page(path, port=port)
        except OSError as e:
            raise UsageError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({e.strerror})") from None
        host, bound = server.server_address[:2]
        click.echo(f"serving on http://{host}:{bound}/ (Ctrl-C to stop)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
