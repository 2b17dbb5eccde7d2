"""The native decoding step: every block of a cached decoding step in one C++ call, bit for bit.

A decoding step of SmolLM2 on one row is 151 matrix products (~21 ms on this project's 2-core CPU) and
~25 small operations per block between them: norms, the rotation, the cache writes, attention, the
activation, the residual adds. The Python step (:func:`headspace.block.decode_layer_rows`) pays
1.5-2.5 us of interpreter and argument parsing for each, ~2 ms a token. ``decode_rows.cpp`` (beside
this file) makes the same roundings in one call per token: the products, attention, the norms' sums
and the activation are the same ATen calls, and the elementwise steps around them float32 loops
(compiled without fused multiply-adds), so its logits are the Python step's bit for bit (tested).

It is compiled on first use by the system's C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``) against the installed torch's headers (~10 s), into a cache folder
(``$HEADSPACE_CACHE``, else ``$XDG_CACHE_HOME/headspace``, else ``~/.cache/headspace``) under a name
hashed from the source, torch's version and the compiler, written atomically; later processes only
load it. :func:`start_build` compiles in a background thread, so that the first
:meth:`headspace.Decoder.generate` does not wait (its steps run in Python until the library is
loaded); :func:`build` waits. Without a compiler, or where the build fails, decoding stays the Python
step (one warning says why). ``HEADSPACE_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("decode_rows.cpp")
"""The C++ source of ``torch.ops.headspace.decode_rows``."""
LAYER_PARAMS, LAYER_INTS, LAYER_FLOATS = 19, 11, 3
"""What each block passes to the op (see the source's header): tensors, ints and floats."""
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_state: dict[str, object] = {"status": "not built", "thread": None, "warned": False}
_op = None  # torch.ops.headspace.decode_rows once loaded


def enabled() -> bool:
    """Whether the native step may be used (``HEADSPACE_NATIVE`` is not 0/false/off/no)."""
    return os.environ.get("HEADSPACE_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Where built libraries are kept: ``$HEADSPACE_CACHE``, ``$XDG_CACHE_HOME/headspace`` or
    ``~/.cache/headspace``."""
    if os.environ.get("HEADSPACE_CACHE"):
        return Path(os.environ["HEADSPACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "headspace"


def compiler() -> str | None:
    """The C++ compiler a build would run (``$CXX``, else the first of c++, g++, clang++ found)."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _torch_lib() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib")


def library_path(cxx: str | None = None) -> Path:
    """The built library's path for this source, torch and compiler."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(f"|{torch.__version__}|{_torch_lib()}|{cxx or compiler()}|{sys.platform}".encode())
    return cache_dir() / "native" / f"headspace_decode_rows_{key.hexdigest()[:20]}.so"


def _command(cxx: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    lib = _torch_lib()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx, "-O2", "-std=c++20", "-ffp-contract=off", "-shared", "-fPIC", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()), str(SOURCE), "-o", str(out),
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]  # fmt: skip


def _compile(path: Path, cxx: str) -> str | None:
    """Compile the source into ``path`` (atomically: a temporary file renamed); the reason on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            _command(cxx, Path(tmp)), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return f"{cxx} exited with {done.returncode}: " + " / ".join(tail)
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx} could not run: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_into(state: dict[str, object], path: Path, cxx: str) -> None:
    """Compile (in the background thread), then say how it went in ``state`` (the dict the thread was
    started for, so that a state replaced meanwhile is left alone)."""
    reason = _compile(path, cxx)
    with _lock:
        state["status"] = "built" if reason is None else "failed"
        state["reason"] = reason


def _untrusted(path: Path) -> str | None:
    """Why a library found in the cache may not be loaded (it, or its folder, belongs to another user
    or is writable by others: code someone else could have put there), or None."""
    if not hasattr(os, "getuid"):
        return None
    for p in (path, path.parent):
        st = p.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return (
                f"{p} belongs to another user or is writable by others, so {path.name} was not loaded "
                "(remove it, or point HEADSPACE_CACHE at a folder of your own)"
            )
    return None


def status() -> str:
    """``"loaded"``, ``"building"``, ``"built"`` (compiled, loaded at the next :func:`ready`),
    ``"failed: <why>"``, ``"off"`` (``HEADSPACE_NATIVE=0``) or ``"not built"``."""
    if _op is not None:
        return "loaded"
    if not enabled():
        return "off"
    with _lock:
        s = str(_state["status"])
        return f"failed: {_state.get('reason')}" if s == "failed" else s


def start_build() -> None:
    """Load the library when it is built already, else start compiling it in a background thread
    (once per process; nothing where it is off, loaded, building or failed)."""
    if _op is not None or not enabled():
        return
    with _lock:
        if _state["status"] != "not built":
            return
        if sys.platform == "win32":
            _state["status"], _state["reason"] = "failed", "the native step is built on Linux and macOS only"
            return
        cxx = compiler()
        if cxx is None:
            _state["status"] = "failed"
            _state["reason"] = "no C++ compiler found (set CXX, or install g++ or clang++)"
            return
        path = library_path(cxx)
        _state["path"] = path
        if path.is_file():
            doubt = _untrusted(path)
            _state["status"], _state["reason"] = ("built", None) if doubt is None else ("failed", doubt)
            return
        _state["status"] = "building"
        thread = threading.Thread(
            target=_build_into, args=(_state, path, cxx), name="headspace-native-build", daemon=True
        )
        _state["thread"] = thread
    thread.start()


def ready(*, warn: bool = True) -> bool:
    """Whether the op is loaded; loads a finished build (in the calling thread). Cheap once loaded.
    Where the build failed, the first call with ``warn`` warns once why (a RuntimeWarning)."""
    global _op
    if _op is not None:
        return True
    if not enabled():
        return False
    with _lock:
        if _state["status"] != "built":
            failed = warn and _state["status"] == "failed" and not _state["warned"]
            if failed:
                _state["warned"] = True
                warnings.warn(
                    f"headspace's native decoding step is unavailable ({_state.get('reason')}); "
                    "decoding runs the Python step, which gives the same logits, ~2 ms a token slower "
                    "on SmolLM2",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False
        path = _state["path"]
        try:
            # a namespace registers once per process (a second TORCH_LIBRARY aborts it): load a build
            # only where no library of this process registered the op already
            if not _registered():
                torch.ops.load_library(str(path))
            _op = torch.ops.headspace.decode_rows
        except (OSError, RuntimeError, AttributeError) as e:
            _state["status"], _state["reason"] = "failed", f"{path} could not be loaded: {e}"
            return False
    return True


def _registered() -> bool:
    """Whether ``headspace::decode_rows`` is registered in this process already."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(
            "headspace::decode_rows", "CompositeExplicitAutograd"
        )
    except RuntimeError:  # "operator headspace::decode_rows does not exist"
        return False


def build() -> bool:
    """Build (or load) the library now and wait for it; whether it is loaded (:func:`status` says why
    not)."""
    start_build()
    thread = _state.get("thread")
    if isinstance(thread, threading.Thread):
        thread.join()
    return ready(warn=False)


def decode_rows(
    x: Tensor,
    params: Sequence[Tensor | None],
    ints: Sequence[int],
    floats: Sequence[float],
    k_all: Tensor,
    v_all: Tensor,
    start: int,
    cos: Tensor | None,
    sin: Tensor | None,
) -> Tensor:
    """Every block and the final norm on the new position ``start``'s rows ``x`` [batch, d_model] ->
    [batch, d_model]: the new keys and values written into the stacked caches ``k_all``/``v_all``
    [layers, batch, n_kv_heads, capacity, d_head] at ``start``. Call only after :func:`ready`."""
    assert _op is not None, "call headspace.kernels.native.ready() first"
    return _op(x, params, ints, floats, k_all, v_all, start, cos, sin)
