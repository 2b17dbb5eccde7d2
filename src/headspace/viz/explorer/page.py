"""The explorer page: one self-contained HTML file (its CSS, JS and data inline, no request made).

``render_page(data)`` fills the packaged ``assets/template.html`` with ``explorer.css``, ``explorer_draw.js``
then ``explorer.js`` (one script), and the JSON of :func:`~headspace.viz.explorer.data.build_page_data`;
``write_page`` writes it atomically; :class:`Explorer` does both from a model and a sentence and shows
inline in Jupyter; ``serve_page`` serves a written page on localhost.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...core.fileio import write_atomic
from . import blob
from .data import LayerCapture, build_page_data, capture_layers
from .results import check_views_fit, result_views

#: Flags for opening the page in a headless Chromium with no network at all (the browser test and
#: benchmarks/explorer.py use them): no sandbox (root), no GPU, no background requests of its own.
HEADLESS_CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

_PLACEHOLDERS = re.compile(r"/\*__CSS__\*/|/\*__JS__\*/|__DATA__|__TITLE__|__BLOB__")


@cache
def asset(name: str) -> str:
    """The text of a packaged asset (``template.html``, ``explorer_draw.js``, ``explorer.js``,
    ``explorer.css``)."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def _json_for_script(data: dict[str, Any], *, ascii_only: bool = False) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``</`` or ``<!--`` can end the element
    (``ascii_only``: every non-ASCII character as ``\\uXXXX``)."""
    text = json.dumps(data, ensure_ascii=ascii_only, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_page(data: dict[str, Any]) -> str:
    """The whole HTML page for ``data`` (from :func:`build_page_data`) as a string.

    A page whose arrays reach :data:`.blob.BLOB_MIN_CHARS` of base64 stores them as one deflated block,
    one byte a character, in a windows-1252 page (:mod:`.blob`; write it with :func:`write_page`, which
    writes those bytes); a smaller one is UTF-8 with base64 arrays."""
    if not isinstance(data, dict) or "layers" not in data or "tokens" not in data:
        raise TypeError("data must be the dict from build_page_data (with 'tokens' and 'layers')")
    title = html.escape(str(data.get("title", "headspace explorer")))
    template, css, block = asset("template.html"), asset("explorer.css"), ""
    js = "\n".join(
        asset(a) for a in ("explorer_draw.js", "explorer_mechanisms.js", "explorer.js")
    )  # helpers first
    big = blob.base64_chars(data) >= blob.BLOB_MIN_CHARS
    if big:
        data, deflated = blob.to_blob(data)
        block = (
            f'\n<script type="application/octet-stream" id="explorer-blob">{blob.escape(deflated)}</script>'
        )
        js, css = blob.ascii_script(js), blob.ascii_script(css)
        template = template.replace(blob.UTF8_META, blob.BLOB_META, 1)
        title = title.encode("ascii", "xmlcharrefreplace").decode("ascii")
    parts = {
        "/*__CSS__*/": css, "/*__JS__*/": js, "__DATA__": _json_for_script(data, ascii_only=big),
        "__TITLE__": title, "__BLOB__": block,
    }  # fmt: skip
    # one pass, so nothing inserted (a token that reads "__DATA__") is substituted again
    return _PLACEHOLDERS.sub(lambda m: parts[m.group(0)], template)


def write_page(path: str | os.PathLike[str], page: str) -> Path:
    """Write ``page`` to ``path`` atomically (temp file in the same folder, then ``os.replace``), in its
    charset (:func:`.blob.page_bytes`)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"output folder {str(folder)!r} does not exist (for output file {str(path)!r})")
    write_atomic(path, blob.page_bytes(page))
    return path


def initial_selection(captures: Sequence[LayerCapture], labels: Sequence[str]) -> dict[str, int]:
    """Where the page opens: the token ``headspace explain`` follows by default ("it" if the input has it,
    else its first non-special token) and the head it walks for that token (:func:`headspace.explain.
    rank_heads`: the best relational head)."""
    from ...analysis.lesson.explain import default_index, rank_heads, special_positions, value_norms

    index = default_index(labels)
    norms = [value_norms(c.v, c.attn.W_O) for c in captures]  # (H, S) each
    patterns = [c.pattern for c in captures]  # (H, S, S) each
    best = rank_heads(patterns, labels, index, special_positions(None, labels), norms=norms)[0]
    return {"layer": best.layer, "head": best.head, "token": index}


def _token_labels(pretrained: Any, sentence: str, ids: Sequence[int]) -> list[str]:
    """The token strings of ``sentence`` from the tokenizer, readable as the command line prints them
    (``"Ġcat"`` -> ``"␣cat"``: :func:`headspace.tokenization.readable_token`); ids as text when it cannot
    say."""
    tok = getattr(pretrained, "tokenizer", None)
    labels = tok.tokens(sentence) if hasattr(tok, "tokens") else None
    if labels is None or len(labels) != len(ids):
        return [str(i) for i in ids]
    show = getattr(tok, "readable", str)
    return [show(str(t)) for t in labels]


def _input_tokens(
    model: Any, module: nn.Module, sentence: str | Tensor | Sequence[int], labels: Sequence[str] | None
) -> tuple[Tensor, Sequence[str], str]:
    """The explorer's input: ``(tokens [1, seq] int64, labels, text)``; a sentence is tokenized by a
    pretrained ``model`` (labels from its tokenizer unless given, text the sentence), token ids are taken
    as they are (labels their ids as text unless given, text empty)."""
    if isinstance(sentence, str):
        if not (hasattr(model, "model") and hasattr(model, "tokenize")):
            raise TypeError(
                "a sentence needs a model with a tokenizer (headspace.load(...)); for a bare module pass "
                "an int64 token tensor [1, seq] instead"
            )
        if not sentence.strip():
            raise ValueError("sentence is empty; give at least one word")
        encoded = model.tokenize([sentence])
        # PretrainedEncoder.tokenize -> (tokens, key_padding); PretrainedDecoder.tokenize -> tokens.
        # One sentence has no padding: tokens is (1, seq).
        tokens = encoded[0] if isinstance(encoded, tuple) else encoded
        if labels is None:
            labels = _token_labels(model, sentence, tokens[0].tolist())
        max_len = getattr(getattr(module, "config", None), "max_seq_len", None)
        if max_len is not None and tokens.shape[1] > max_len:
            raise ValueError(
                f"sentence has {tokens.shape[1]} tokens but the model's position table holds "
                f"max_seq_len={max_len}; shorten the sentence"
            )
        return tokens, labels, sentence
    tokens = torch.as_tensor(sentence)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)  # (seq,) -> (1, seq)
    if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.dtype != torch.int64:
        raise ValueError(
            "sentence must be a str (for a pretrained model) or an int64 token tensor [1, seq] "
            "(one sequence); got dtype "
            f"{tokens.dtype} and shape {list(tokens.shape)}"
        )
    return tokens, [str(i) for i in tokens[0].tolist()] if labels is None else labels, ""


class Explorer:
    """The explorer page of one model on one input.

    ``Explorer(pretrained, "a sentence")`` for a pretrained object (``headspace.load("minilm")``: it has
    ``.model``, ``.tokenizer`` and ``.tokenize``), or ``Explorer(model, tokens)`` for any module with
    headspace attention layers and an int64 token tensor [1, seq] (labels via ``labels=``). In Jupyter
    the object shows the page inline (``_repr_html_``: an iframe holding the whole page); ``.html`` is
    the page, ``.save(path)`` writes it, ``.data`` is what it embeds.

    ``results`` adds saved causal results as heatmaps (the page's fifth view): a
    :class:`~headspace.analysis.patching.PatchResult`, a
    :class:`~headspace.analysis.attribution.LogitAttribution` or
    :class:`~headspace.analysis.attribution.LogitLens`, their ``to_dict()``, the path of their
    ``to_json(path)`` file (or of ``headspace patch/attribute --json`` output), or a list of those. Each
    must be of a model with the same layers and heads as ``model`` (a ``ValueError`` otherwise).
    """

    def __init__(
        self,
        model: Any,
        sentence: str | Tensor | Sequence[int],
        *,
        labels: Sequence[str] | None = None,
        precision: str = "auto",
        name: str | None = None,
        run: Callable[[], Any] | None = None,
        results: Any = None,
    ) -> None:
        views = result_views(results)  # first: a bad result file fails before the forward pass
        is_pretrained = hasattr(model, "model") and hasattr(model, "tokenize")
        module = model.model if is_pretrained else model
        if not isinstance(module, nn.Module):
            raise TypeError(
                "model must be a pretrained object (headspace.load(...)) or a torch.nn.Module with headspace "
                f"attention layers; got {type(model).__name__}"
            )
        tokens, labels, text = _input_tokens(model, module, sentence, labels)

        def default_run() -> Any:
            return module(tokens)

        if labels is not None and len(labels) != tokens.shape[1]:
            raise ValueError(
                f"labels has {len(labels)} entries but the input has {tokens.shape[1]} tokens; "
                "give one label per token"
            )
        was_training = module.training
        module.eval()
        try:
            captures = capture_layers(module, run or default_run)
        finally:
            module.train(was_training)
        check_views_fit(views, len(captures), max(c.attn.n_heads for c in captures))
        config_name = getattr(getattr(module, "config", None), "name", "")
        self.name = name or config_name or type(module).__name__
        self.data = build_page_data(
            captures,
            list(labels),
            title=f"headspace explorer: {self.name}",
            model_name=str(self.name),
            sentence=text,
            precision=precision,
            initial=initial_selection(captures, list(labels)),
            results=views,
        )
        self.captures = captures
        self._html: str | None = None

    @property
    def html(self) -> str:
        if self._html is None:
            self._html = render_page(self.data)
        return self._html

    def save(self, path: str | os.PathLike[str]) -> Path:
        return write_page(path, self.html)

    def _repr_html_(self) -> str:
        return (
            f'<iframe srcdoc="{html.escape(self.html, quote=True)}" sandbox="allow-scripts" '
            'style="width: 100%; height: 900px; border: 1px solid #ddd;" title="headspace explorer"></iframe>'
        )


#: What a client that goes away mid-download raises in the server (nothing to report: it left).
_CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class PageServer(ThreadingHTTPServer):
    """A localhost HTTP server that answers every GET of ``/`` with one page (``set_page``).

    Bound when created, so a port in use is known before any page is built; until ``set_page`` it
    answers 503. A client that disconnects mid-download is dropped quietly; the server keeps serving.
    """

    daemon_threads = True
    body: bytes | None = None
    page_name = "explorer.html"

    def set_page(self, path: str | os.PathLike[str]) -> None:
        self.body = Path(path).read_bytes()
        self.page_name = Path(path).name

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], _CLIENT_GONE):
            return
        super().handle_error(request, client_address)


class _PageHandler(BaseHTTPRequestHandler):
    server: PageServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/", "/index.html", "/" + self.server.page_name):
            self.send_error(404, "the explorer serves one page, at /")
            return
        body = self.server.body
        if body is None:
            self.send_error(503, "the page is being built; reload in a few seconds")
            return
        try:
            self.send_response(200)
            self.send_header("Content-Type", f"text/html; charset={blob.page_charset(body)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except _CLIENT_GONE:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


def page_server(*, port: int = 8000, host: str = "127.0.0.1") -> PageServer:
    """A bound :class:`PageServer` with no page yet (``port=0`` picks a free port); raises ``OSError``
    when the port cannot be bound."""
    return PageServer((host, port), _PageHandler)


def serve_page(path: str | os.PathLike[str], *, port: int = 8000, host: str = "127.0.0.1") -> PageServer:
    """A localhost HTTP server that answers every GET with the page at ``path`` (call ``serve_forever``).

    ``port=0`` picks a free port (``server.server_address[1]``).
    """
    server = page_server(port=port, host=host)
    try:
        server.set_page(path)
    except BaseException:
        server.server_close()
        raise
    return server
