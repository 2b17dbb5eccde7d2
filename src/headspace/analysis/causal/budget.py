"""Bounds of the causal tools: prompts inside the position table, and a run's peak memory estimated from
its shape before anything is allocated.

**Prompt length.** :func:`check_length` refuses token ids longer than the model's position table
(``config.max_seq_len``) with the words every model forward uses (:func:`headspace.nn.inputs.check_tokens`:
``"... has length 9000, longer than the position table (max_seq_len=8192); refused, not truncated: ..."``),
before any forward runs (the circuit graph runs call no model forward, so nothing else would refuse them).

**Memory.** The estimates count the tensors a run holds at its peak, in bytes, from the model's shape
(``L`` layers, ``H`` query heads, ``Hkv`` key/value heads, ``dh``, ``d_model``, ``d_mlp``, ``vocab``, the
weights' element size) and the run's (``B`` rows a pass, ``S`` positions):

* circuits (:func:`circuit_bytes`): ``B S d_model`` times the senders' activations of the clean and
  corrupt runs and their difference (``3 U``, ``U = 1 + L (H + 1)``), the receivers' gradients (``R = L (H
  + 2 Hkv + 1) + 1``) and the residual streams, plus what autograd keeps per layer for EAP / EAP-IG (the
  same for any number of EAP-IG steps: the path's gradients are summed in place); a circuit run
  (``"run"``: faithfulness, the curve) holds no gradients but its per-receiver inputs; a backward also
  keeps every layer's attention scores, ``3 L B H S^2`` floats (measured: the squared term dominates past
  about a thousand tokens on SmolLM2);
* patching (:func:`patch_bytes`): the clean and corrupt runs' traces, plus per patched run in a batch its
  stream through one block, its key/value cache and a block of attention scores;
* attribution (:func:`attribution_bytes`): one traced forward (``"dla"``, ``"lens"``: the logits of every
  position, the recorded streams) or, for attribution patching (``"grad"``), a forward kept for backward
  with every layer's attention pattern.

They are upper bounds of the measured peaks, within a small factor, on the tested shapes
(tests/analysis/test_budget.py). :func:`check_memory` compares one with the limit: ``max_memory`` where
given (bytes, or a size such as ``"8G"``), else the environment variable ``HEADSPACE_MAX_MEMORY``, else
the memory available now (``MemAvailable`` of /proc/meminfo; no limit where that cannot be read), and
refuses a run above it with :class:`MemoryBudgetError` (a ``ValueError``) naming both.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ...attention.functional import TRACED_BLOCK_BYTES, TRACED_MIN_ROWS
from ...core.checks import is_int
from ...kernels.prepack import available_memory_bytes
from ...nn.inputs import check_tokens

__all__ = [
    "ENV_MAX_MEMORY",
    "MemoryBudgetError",
    "ModelShape",
    "attribution_bytes",
    "check_backward",
    "check_length",
    "check_memory",
    "circuit_bytes",
    "fit_runs",
    "format_bytes",
    "memory_limit",
    "parse_memory",
    "patch_bytes",
    "shape_of",
]

#: The environment variable that sets the memory limit (a size such as ``8G`` or a number of bytes).
ENV_MAX_MEMORY = "HEADSPACE_MAX_MEMORY"

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


class MemoryBudgetError(ValueError):
    """A run whose estimated peak memory is above the limit (refused before anything is allocated)."""


def parse_memory(value: Any, what: str = "max_memory") -> int:
    """A memory size in bytes from an int (bytes) or a string: ``"8G"``, ``"512M"``, ``"1.5GiB"``,
    ``"1000000"`` (K, M, G, T are powers of 1024). Anything else, or a size < 1 byte, is a ``ValueError``."""
    if is_int(value):
        size = int(value)
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(
            f"{what} must be a memory size: a number of bytes or a number with K, M, G or T (e.g. 8G, "
            f"512M); got {value!r}"
        )
    if size < 1:
        raise ValueError(f"{what} must be at least 1 byte; got {value!r}")
    return size


def memory_limit(max_memory: Any = None, device: torch.device | None = None) -> tuple[int | None, str]:
    """(the limit in bytes or None, where it came from): ``max_memory``, else ``$HEADSPACE_MAX_MEMORY``,
    else the memory free now: a CUDA ``device``'s (:func:`torch.cuda.mem_get_info`), otherwise
    ``MemAvailable`` (None where /proc/meminfo cannot be read: no limit)."""
    if max_memory is not None:
        return parse_memory(max_memory), f"max_memory={max_memory}"
    env = os.environ.get(ENV_MAX_MEMORY)
    if env is not None and env.strip():
        return parse_memory(env, ENV_MAX_MEMORY), f"{ENV_MAX_MEMORY}={env.strip()}"
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), f"the memory free on {device} now"
    return available_memory_bytes(), "the memory available now, MemAvailable of /proc/meminfo"


def format_bytes(n: float) -> str:
    """``n`` bytes in words: ``"23.70 GiB"``, ``"312.5 MiB"``, ``"900 bytes"``."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{int(n)} bytes"


def check_memory(
    estimate: int,
    what: str,
    shape: str,
    hint: str,
    max_memory: Any = None,
    device: torch.device | None = None,
) -> None:
    """Refuse a run of ``estimate`` bytes above :func:`memory_limit` (``what``: the run, ``shape``: its
    shape in words, ``hint``: how to make it smaller), naming the estimate and the limit."""
    limit, source = memory_limit(max_memory, device)
    if limit is None or estimate <= limit:
        return
    raise MemoryBudgetError(
        f"{what} needs an estimated {format_bytes(estimate)} at its peak ({shape}), more than the limit "
        f"of {format_bytes(limit)} ({source}); {hint}, or raise the limit (--max-memory, "
        f"{ENV_MAX_MEMORY}, max_memory=)"
    )


def check_length(module: Any, tokens: torch.Tensor, name: str) -> None:
    """Token ids [rows, seq] no longer than the position table, in :func:`check_tokens`' words (its length
    check alone: the ids themselves are the model forward's to check, in its words)."""
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "max_seq_len", None) is not None:
        check_tokens(tokens[:0], config, name=name)  # (0, seq): the shape without the values


@dataclass(frozen=True)
class ModelShape:
    """What the estimates read of a model: layers, heads, widths, vocabulary, bytes per element."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_mlp: int
    vocab: int
    itemsize: int

    @property
    def senders(self) -> int:
        """``U = 1 + L (H + 1)``: the embeddings, every head, every MLP."""
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def receivers(self) -> int:
        """``R = L (H + 2 Hkv + 1) + 1``."""
        return self.n_layers * (self.n_heads + 2 * self.n_kv_heads + 1) + 1

    def layer_floats(self, grad: bool = True) -> int:
        """Floats per position that one layer's forward makes (its norms, q/k/v and their rotations, the
        heads' outputs, the MLP's hidden layers and outputs): what autograd keeps of it (``grad``), or the
        most a forward without autograd holds at once while it runs a layer."""
        H, Hkv, dh, d = self.n_heads, self.n_kv_heads, self.d_head, self.d_model
        if not grad:
            return 4 * d + (3 * H + 2 * Hkv) * dh + 3 * self.d_mlp
        return 10 * d + (6 * H + 4 * Hkv) * dh + 4 * self.d_mlp


def shape_of(module: Any) -> ModelShape:
    """The :class:`ModelShape` of an Encoder/Decoder (its config; the widest layer's heads)."""
    c = module.config
    blocks = getattr(module, "blocks", [])
    H = max([getattr(b.attn, "n_heads", c.n_heads) for b in blocks] or [c.n_heads])
    Hkv = c.n_kv_heads or c.n_heads
    itemsize = next(module.parameters()).element_size()
    d_head = c.d_head or c.d_model // c.n_heads
    return ModelShape(len(blocks) or c.n_layers, H, Hkv, d_head, c.d_model, c.d_mlp, c.vocab_size, itemsize)


def _scores_block(m: ModelShape, rows: int, seq_q: int, seq_k: int) -> int:
    """Bytes of the traced path's scores and pattern for one layer: the whole [rows, H, seq_q, seq_k]
    where it fits :data:`TRACED_BLOCK_BYTES`, else its largest block of query rows
    (:func:`headspace.attention.functional.row_blocks`), and the block's bool mask."""
    per_row = max(1, rows * m.n_heads * seq_k * m.itemsize)
    block = max(TRACED_MIN_ROWS, TRACED_BLOCK_BYTES // per_row)
    n = seq_q if block >= seq_q else min(seq_q, 2 * block)  # a short last block joins the one before
    return 3 * per_row * n + n * seq_k  # the scores, their masked copy, the pattern; the mask


def _kept_scores(m: ModelShape, rows: int, seq: int) -> int:
    """Bytes of every layer's attention scores that a backward keeps: [rows, H, seq, seq] per layer, about
    three floats an entry (measured on SmolLM2: its EAP peak grows by ~3 KB per pair and squared token)."""
    return 3 * m.n_layers * rows * m.n_heads * seq * seq * m.itemsize


def circuit_bytes(m: ModelShape, rows: int, seq: int, method: str) -> int:
    """Peak bytes of one pass of :mod:`.circuits` over ``rows`` pairs of ``seq`` positions: ``method``
    ``"eap"`` or ``"eap-ig"`` (edge scores, any steps), or ``"run"`` (circuit runs: faithfulness, curve)."""
    t, d = rows * seq, m.d_model
    L, H, Hkv, dh = m.n_layers, m.n_heads, m.n_kv_heads, m.d_head
    U, R, Q = m.senders, m.receivers, H + 2 * Hkv
    # the corrupt run's activations, streams and mixed values; the embeddings
    floats = t * ((U + 2 * L + 4) * d + L * H * dh)
    if method == "run":  # the activations' list and their concatenation; a patched run's deltas and inputs
        floats += t * ((2 * U + 3 * Q) * d + m.layer_floats(grad=False))
    else:  # the clean run's activations (list and concatenation), the deltas, the receivers' gradients,
        # autograd's saved layers and one layer's pulled-back gradients
        floats += t * ((2 * U + R + 2 * Q) * d + L * m.layer_floats())
    logits = 2 * rows * m.vocab
    kept = 0 if method == "run" else _kept_scores(m, rows, seq)
    return (floats + logits) * m.itemsize + kept


def patch_bytes(
    m: ModelShape, runs: int, seq: int, new: int, *, grad: bool = False, traced: bool = True
) -> int:
    """Peak bytes of :func:`.patching.patch` (``grad=False``, ``runs`` patched runs in one batch, ``new``
    positions from the first difference on) or of :func:`.patching.attribution_patching` (``grad=True``:
    one run kept for backward, ``runs`` ignored; ``traced``: its hooks are on the heads, so every layer
    runs the traced attention and keeps its pattern for backward)."""
    L, H, dh, d = m.n_layers, m.n_heads, m.d_head, m.d_model
    traces = seq * L * (3 * d + 2 * H * dh) + 2 * m.vocab  # the clean and corrupt runs' recordings
    if grad:
        kept = seq * (L * (m.layer_floats() + 2 * d + H * dh) + 2 * d)
        # the traced attention keeps every layer's pattern for backward, block after block
        scores = (_kept_scores(m, 1, seq) if traced else 0) + _scores_block(m, 1, seq, seq)
        return (traces + kept + 2 * m.vocab) * m.itemsize + scores
    per_run = (
        new * (m.layer_floats(grad=False) + 3 * d + 2 * H * dh) + 4 * m.n_kv_heads * seq * dh + 2 * m.vocab
    )
    return (traces + runs * per_run) * m.itemsize + _scores_block(m, runs, new, seq)


def attribution_bytes(m: ModelShape, prompts: int, seq: int, kind: str) -> int:
    """Peak bytes of one traced forward of ``prompts`` prompts of ``seq`` positions: ``"dla"`` (direct
    logit attribution: the heads' results, the MLPs' outputs) or ``"lens"`` (the logit lens: the streams);
    both hold the logits of every position."""
    L, H, d = m.n_layers, m.n_heads, m.d_model
    t = prompts * seq
    recorded = L * (H * m.d_head + 2 * d) + 2 * H * d if kind == "dla" else (L + 2) * d
    floats = t * (recorded + m.layer_floats(grad=False) + 2 * m.vocab) + 2 * prompts * (L + 1) * m.vocab
    # recording the heads' results runs the traced attention (a block of scores); the streams do not
    return floats * m.itemsize + (_scores_block(m, prompts, seq, seq) if kind == "dla" else 0)


def fit_runs(
    m: ModelShape, runs: int, seq: int, new: int, max_memory: Any = None, device: torch.device | None = None
) -> int:
    """The patched runs one batch of :func:`.patching.patch` may hold: ``runs``, halved while
    :func:`patch_bytes` is above the limit (the sweep then runs in more, smaller batches: the same runs);
    a single run above it is refused (:class:`MemoryBudgetError`, naming the estimate and the limit)."""
    limit, _ = memory_limit(max_memory, device)
    runs = max(1, runs)
    while runs > 1 and limit is not None and patch_bytes(m, runs, seq, new) > limit:
        runs //= 2
    check_memory(
        patch_bytes(m, runs, seq, new), "activation patching",
        f"{runs} patched run{'s' * (runs != 1)} of {seq} tokens a batch, {new} of them after the first "
        f"difference, {m.n_layers} layers, {m.n_heads} heads, d_model {m.d_model}",
        "use a shorter prompt pair", max_memory, device,
    )  # fmt: skip
    return runs


def check_backward(m: ModelShape, tokens: torch.Tensor, traced: bool, max_memory: Any = None) -> None:
    """Refuse :func:`.patching.attribution_patching` of a prompt pair of ``tokens`` [1, seq] above the
    limit (:func:`patch_bytes` with ``grad=True``)."""
    seq, device = tokens.shape[1], tokens.device
    check_memory(
        patch_bytes(m, 1, seq, seq, grad=True, traced=traced), "attribution patching",
        f"one prompt pair of {seq} tokens kept for backward, {m.n_layers} layers, {m.n_heads} heads, "
        f"d_model {m.d_model}", "use a shorter prompt pair", max_memory, device,
    )  # fmt: skip
