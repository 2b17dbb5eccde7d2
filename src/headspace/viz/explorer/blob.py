"""A large explorer page's arrays as one deflated binary block, one byte a character (issue 41).

A page's arrays travel as base64 (:func:`~.data.pack`, :func:`~.codec.encode_grid`): 4 characters for
3 bytes. SmolLM2's page at 14 tokens holds 7.9 MB of array bytes (W_O as 4-bit codes 6.2 MB, q, k, v
1.6 MB), 10.6 MB as base64. A page whose base64 arrays reach :data:`BLOB_MIN_CHARS` stores them instead
as one block: their bytes one after another, deflated (``zlib``; the page inflates them with the
browser's ``DecompressionStream("deflate")``), written one byte a character in a
``<script type="application/octet-stream" id="explorer-blob">`` element of a page whose charset is
``windows-1252``, where every byte is one character. Four bytes would break the element or be changed
by the HTML parser (NUL, CR, ``<``) or are the escape itself (``~``): each is written as ``~`` and the
byte plus 64 (mod 256), :func:`escape`. Everything else of such a page is ASCII (non-ASCII text as
``\\uXXXX`` in JSON and script, ``&#N;`` in HTML). In the JSON each base64 field of an array becomes
``{"at": offset, "n": bytes}`` into the inflated block; ``data["blob"]`` says how it is stored.

A smaller page keeps base64 and UTF-8 (its text readable as it was). :func:`page_data` reads either
kind back to the data with base64 arrays (what :func:`~.data.build_page_data` made).
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from collections.abc import Iterator
from typing import Any

#: Base64 characters of arrays from which a page stores them as a deflated block instead.
BLOB_MIN_CHARS = 1_000_000
#: The base64 fields of an array dict (``pack``: ``data``; ``encode_grid``: ``lo``, ``step``, ``codes``).
FIELDS = ("data", "lo", "step", "codes")
#: The charset of a page with a block (one byte a character; the browser's name for latin-1 too).
CHARSET = "windows-1252"
UTF8_META = '<meta charset="utf-8">'
BLOB_META = f'<meta charset="{CHARSET}">'
#: The escape byte and the bytes written escaped.
ESC = 0x7E
_ESCAPED = re.compile(rb"[\x00\r<~]")
_UNESCAPE = re.compile(rb"~(.)", flags=re.S)
#: windows-1252's characters for bytes 0x80..0x9F (five undefined ones decode as the C1 control itself).
_CP1252_HIGH = {bytes([b]).decode("cp1252", errors="ignore") or chr(b): b for b in range(0x80, 0xA0)}


def _arrays(obj: Any) -> Iterator[dict[str, Any]]:
    """Every array dict (``dtype`` and a base64 field) in ``obj``, depth first, in a fixed order."""
    if isinstance(obj, dict):
        if "dtype" in obj and any(isinstance(obj.get(f), str) for f in FIELDS):
            yield obj
            return
        for v in obj.values():
            yield from _arrays(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _arrays(v)


def base64_chars(data: dict[str, Any]) -> int:
    """The base64 characters of every array in ``data``."""
    return sum(len(a[f]) for a in _arrays(data) for f in FIELDS if isinstance(a.get(f), str))


def _copy(obj: Any) -> Any:
    """A copy of the dicts and lists of ``obj`` (strings and numbers shared)."""
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def to_blob(data: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """``(data with every base64 field as {"at", "n"} into the block, the block deflated)``; ``data`` is
    left as it was. The result's ``blob`` is ``{"compression": "deflate", "bytes": inflated size}``."""
    out = _copy(data)
    parts: list[bytes] = []
    at = 0
    for array in _arrays(out):
        for f in FIELDS:
            if isinstance(array.get(f), str):
                raw = base64.b64decode(array[f])
                array[f] = {"at": at, "n": len(raw)}
                parts.append(raw)
                at += len(raw)
    out["blob"] = {"compression": "deflate", "bytes": at}
    return out, zlib.compress(b"".join(parts), 6)


def escape(block: bytes) -> str:
    """``block`` one byte a character (U+0000..U+00FF), NUL, CR, ``<`` and ``~`` as ``~`` + (byte + 64)."""
    return _ESCAPED.sub(lambda m: bytes([ESC, (m[0][0] + 64) & 255]), block).decode("latin-1")


def unescape(text: str) -> bytes:
    """Inverse of :func:`escape`, from the characters as written or as a browser decoded them
    (windows-1252: bytes 0x80..0x9F read as their characters)."""
    raw = bytes(_CP1252_HIGH.get(c, ord(c)) if ord(c) > 0xFF else ord(c) for c in text)
    return _UNESCAPE.sub(lambda m: bytes([(m[1][0] - 64) & 255]), raw)


def from_blob(data: dict[str, Any], block: bytes) -> dict[str, Any]:
    """Inverse of :func:`to_blob`: the data with base64 arrays, from its JSON and the deflated block."""
    raw = zlib.decompress(block)
    if len(raw) != data["blob"]["bytes"]:
        raise ValueError(f"the page's block holds {len(raw)} bytes; its data says {data['blob']['bytes']}")
    out = _copy(data)
    del out["blob"]
    for array in _arrays_at(out):
        for f in FIELDS:
            ref = array.get(f)
            if isinstance(ref, dict):
                array[f] = base64.b64encode(raw[ref["at"] : ref["at"] + ref["n"]]).decode("ascii")
    return out


def _arrays_at(obj: Any) -> Iterator[dict[str, Any]]:
    """Every array dict whose fields point into the block."""
    if isinstance(obj, dict):
        if "dtype" in obj and any(isinstance(obj.get(f), dict) and "at" in obj[f] for f in FIELDS):
            yield obj
            return
        for v in obj.values():
            yield from _arrays_at(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _arrays_at(v)


def ascii_script(text: str) -> str:
    """Script or style text with every non-ASCII character as ``\\uXXXX`` (the same text to JavaScript
    inside strings and templates; comments unchanged in meaning)."""
    return re.sub(r"[^\x00-\x7f]", lambda m: "".join(f"\\u{u:04x}" for u in _utf16(m[0])), text)


def _utf16(c: str) -> list[int]:
    b = c.encode("utf-16-le")
    return [int.from_bytes(b[i : i + 2], "little") for i in range(0, len(b), 2)]


def page_bytes(page: str) -> bytes:
    """The bytes of ``page``: windows-1252 (one byte a character) for a page with a block, else UTF-8."""
    return page.encode("latin-1") if BLOB_META in page[:2048] else page.encode("utf-8")


def page_charset(body: bytes) -> str:
    """The charset a written page declares (for a server's Content-Type)."""
    return CHARSET if BLOB_META.encode("ascii") in body[:2048] else "utf-8"


def page_data(body: bytes) -> dict[str, Any]:
    """The data of a written page (its bytes), arrays as base64, whichever way they were stored."""
    text = body.decode("latin-1" if page_charset(body) == CHARSET else "utf-8")
    data = json.loads(_element(text, "explorer-data"))
    if "blob" not in data:
        return data
    return from_blob(data, unescape(_element(text, "explorer-blob")))


def _element(text: str, element_id: str) -> str:
    start = text.index(f'id="{element_id}"')
    return text[text.index(">", start) + 1 : text.index("</script>", start)]
