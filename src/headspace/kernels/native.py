"""The native decoding step's library: built, cached, checked and loaded here; fed by
:mod:`headspace.decode.native` (every block of a cached decoding step in one C++ call, bit for bit).

``decode_rows.cpp`` (beside this file) registers ``torch.classes.headspace.DecodeStep``: a step's
blocks described by name (:mod:`headspace.decode.step`), run in one call per token with the Python
step's roundings: the products, attention, the norms' sums and the activation are the same ATen calls,
and the elementwise steps around them float32 loops (compiled with ``-O2 -ffp-contract=off``: no fused
multiply-adds), so its logits are the Python step's bit for bit (tested). ``q8_0.cpp`` adds
``torch.ops.headspace.q8_0_mm`` to the same library (:mod:`headspace.kernels.q8_0`).

How it is built:

* By the system's C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) against the installed
  torch's headers (with ``-fopenmp`` where torch's own OpenMP runtime is GNU's ``libgomp.so.1``:
  :func:`openmp_flags`), into a cache folder (``$HEADSPACE_CACHE``, else ``$XDG_CACHE_HOME/headspace``, else
  ``~/.cache/headspace``), at ``native/`` under a name hashed from the source, torch's version and the
  compiler; later processes only load it. ``headspace native build`` (or :func:`build`) builds and
  waits; the first :meth:`headspace.Decoder.generate` that could use it starts the build in the
  background (:func:`start_build`, one line on stderr says so) and decodes in Python until it is done.
* In a child process (``_native_build.py``; a background build's at lower priority, ``os.nice``
  :data:`BACKGROUND_NICE`, so that the decoding beside it keeps its cores) that holds an exclusive
  ``flock`` on the library's ``.lock`` file: a second process building at once waits for it, then
  finds the library built (a background build meanwhile decodes in Python). The kernel drops the
  lock when its holder dies.
* The compiler does not outlive the process that started the build: at exit (``atexit``), or when the
  process dies any other way (the child watches a pipe only the parent holds open), the child kills
  the compiler's whole process group and removes the temporary output; the library appears only by
  an atomic rename of a finished one. A build stopped so is started again the next time.
* A library is loaded, and built, only where it and every folder from the cache root down to it
  belong to the current user and are not writable by group or others (:func:`status` names the path
  otherwise): code another user could have put there is never run. Symbolic links are resolved
  before the check, so a link into a folder others can write is refused too.

Without a compiler, or where the build fails, decoding stays the Python step (one warning says why).
``HEADSPACE_NATIVE=0`` (or false, off, no) turns it off; 1, true, on, yes or unset leave it on; any
other value is refused in one line (:func:`enabled`).

Why not ``torch.utils.cpp_extension.load(..., is_python_module=False)``: it is not faster (the compile
is the time; ``docs/benchmarks.md``), it needs ``ninja``, and its lock (``FileBaton``) is a file created
with ``O_EXCL`` and removed by its holder: a build killed (by the kill at exit above, a Ctrl-C, the OOM
killer) leaves it, and every later load waits on it forever. Its hashed folder, the lock and the
background build are kept here.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_rows.cpp")
"""The C++ source of ``torch.classes.headspace.DecodeStep``."""
SOURCES = (SOURCE, Path(__file__).with_name("q8_0.cpp"))
"""Every C++ source of the library: the step, and ``torch.ops.headspace.q8_0_mm``
(:mod:`headspace.kernels.q8_0`)."""
BUILDER = Path(__file__).with_name("_native_build.py")
"""The script the build runs in (a child process; see its docstring)."""
BUILD_TIMEOUT_S = 600
"""A build (waiting for another's lock included) is stopped past this."""
STOP_WAIT_S = 10
"""At exit, how long the builder is given to stop the compiler and clean up before it is killed."""
BACKGROUND_NICE = 10
"""How much a background build lowers its priority (``os.nice`` in the builder child, inherited by the
compiler): the decoding it runs beside keeps the cores it would share. A build waited for (:func:`build`)
keeps the caller's priority."""

_lock = threading.Lock()
_state: dict[str, object] = {"status": "not built", "thread": None, "warned": False}
_op = None  # the class torch.classes.headspace.DecodeStep once loaded


@dataclass
class _Build:
    """A builder child process this process started."""

    proc: subprocess.Popen[str]
    library: Path
    watch: int | None  # the pipe's write end: open while this process lives; closed, the build stops
    background: bool
    thread: threading.Thread | None = None
    _closing: threading.Lock = field(default_factory=threading.Lock)

    def let_go(self) -> None:
        """Close the pipe's write end (once): the builder, if still running, stops."""
        with self._closing:
            if self.watch is not None:
                os.close(self.watch)
                self.watch = None


_builds: list[_Build] = []  # every build started here: stopped at exit where still running
_announced = False


ENV = "HEADSPACE_NATIVE"
"""The environment variable that turns the native step off (:data:`OFF`) or leaves it on (:data:`ON`)."""
ON = ("1", "true", "on", "yes", "")
"""The values of :data:`ENV` that leave the native step on (case and surrounding blanks ignored)."""
OFF = ("0", "false", "off", "no")
"""The values of :data:`ENV` that turn it off."""


def enabled() -> bool:
    """Whether the native step may be used: ``HEADSPACE_NATIVE`` unset or one of :data:`ON` (True), or
    one of :data:`OFF` (False). Any other value is refused (``ValueError``, one line naming the variable,
    the accepted values and what came), read at every call, as ``HEADSPACE_FORCE_FALLBACK`` is."""
    raw = os.environ.get(ENV, "1")
    value = raw.strip().lower()
    if value in OFF:
        return False
    if value not in ON:
        raise ValueError(
            f"{ENV} must be one of {', '.join(v for v in ON if v)} (on) or {', '.join(OFF)} (off); "
            f"got {raw!r}"
        )
    return True


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
    for source in SOURCES:
        key.update(source.read_bytes())
    cxx = cxx or compiler()
    flags = " ".join(openmp_flags(cxx)) if cxx else ""
    key.update(f"|{torch.__version__}|{_torch_lib()}|{cxx}|{sys.platform}|{flags}".encode())
    return cache_dir() / "native" / f"headspace_decode_rows_{key.hexdigest()[:20]}.so"


def openmp_flags(cxx: str) -> list[str]:
    """``["-fopenmp"]`` where torch's own OpenMP runtime, loaded in this process, is GNU's
    ``libgomp.so.1`` and ``cxx`` is not clang (by the name it resolves to): the library then runs
    ``at::parallel_for`` on torch's own OpenMP threads (the one runtime, found by its name). Otherwise
    none (a renamed or another runtime: ``q8_0.cpp`` then splits its work over threads of its own), also
    with ``HEADSPACE_NATIVE_OPENMP=0``."""
    if os.environ.get("HEADSPACE_NATIVE_OPENMP", "1").strip().lower() in ("0", "false", "off", "no"):
        return []
    if not sys.platform.startswith("linux"):
        return []
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    if not any(line.endswith("/libgomp.so.1") for line in maps.splitlines()):
        return []
    real = os.path.realpath(shutil.which(cxx) or cxx)  # clang's -fopenmp would bring LLVM's runtime
    return [] if "clang" in os.path.basename(real).lower() else ["-fopenmp"]


def _command(cxx: str, out: Path | str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    lib = _torch_lib()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx, "-O2", "-std=c++20", "-ffp-contract=off", "-shared", "-fPIC", "-w", *openmp_flags(cxx),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()), *map(str, SOURCES), "-o", str(out),
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]  # fmt: skip


def _folders(path: Path, root: Path) -> list[Path]:
    """The folders from ``root`` down to ``path``'s folder (``path``'s folder alone where ``root`` is
    not above it)."""
    chain = [path.parent]
    while chain[-1] != root and chain[-1].parent != chain[-1] and root in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain[::-1]


def _doubt(p: Path) -> bool:
    """Whether ``p`` belongs to another user or is writable by group or others."""
    st = p.stat()
    return st.st_uid != os.getuid() or bool(st.st_mode & 0o022)


def _untrusted(path: Path, root: Path | None = None) -> str | None:
    """Why a library may not be loaded (it, or a folder from the cache root ``root`` down to it,
    belongs to another user or is writable by others: code someone else could have put there), or
    None. Symbolic links are resolved first: the file a link leads to, and the folders from the
    resolved root down to it (its own folder alone where it lies outside the root), are checked too."""
    if not hasattr(os, "getuid"):
        return None
    root = cache_dir() if root is None else root
    real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    # the folders as named and as resolved: a symbolic link (the library's, or a folder's) may lead
    # into a folder others can write, which the named chain alone would not show
    folders = dict.fromkeys([*_folders(path, root), *_folders(real, real_root)])
    for folder in folders:
        if _doubt(folder):
            return (
                f"{folder} belongs to another user or is writable by others, so {path.name} was not "
                "loaded (make it yours and not writable by others, or point HEADSPACE_CACHE at a folder "
                "of your own)"
            )
    if _doubt(real):
        return (
            f"{path} belongs to another user or is writable by others, so {path.name} was not loaded "
            "(remove it, or point HEADSPACE_CACHE at a folder of your own)"
        )
    return None


def _prepare(path: Path) -> str | None:
    """Make the folders from the cache root down to ``path``'s (new ones: the user's alone); why the
    library may not be built there, or None."""
    root = cache_dir()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        for folder in _folders(path, root):
            if not folder.is_dir():
                os.mkdir(folder, 0o700)
    except OSError as e:
        return f"could not make the folder {path.parent}: {e}"
    if not hasattr(os, "getuid"):
        return None
    for folder in _folders(path, root):
        if _doubt(folder):
            return (
                f"{folder} belongs to another user or is writable by others, so the native step is not "
                "built into it (make it yours and not writable by others, or point HEADSPACE_CACHE at a "
                "folder of your own)"
            )
    return None


def _spawn(path: Path, cxx: str, background: bool) -> _Build:
    """Start the builder child (in a session of its own; it stops when this process goes); a
    ``background`` one at :data:`BACKGROUND_NICE` lower priority."""
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(BUILDER), "--watch", str(read), "--timeout", str(BUILD_TIMEOUT_S),
             "--nice", str(BACKGROUND_NICE if background else 0), str(path), "--", *_command(cxx, "@OUT@")],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            pass_fds=(read,), start_new_session=True,
        )  # fmt: skip
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    build = _Build(proc, path, write, background)
    if not _builds:
        atexit.register(_stop_builds)
    _builds.append(build)
    return build


def _wait_for(state: dict[str, object], build: _Build) -> None:
    """Wait for the builder (in the background thread), then say how it went in ``state`` (the dict
    the thread was started for, so that a state replaced meanwhile is left alone)."""
    out, err = build.proc.communicate()
    build.let_go()
    rc = build.proc.returncode
    if rc == 0:
        reason = None
    elif rc == 1 and err.strip():
        reason = err.strip().splitlines()[-1]
    elif rc == 3:
        reason = "the build was stopped unfinished (this process let go of it)"
    else:
        reason = f"the build process ended with {rc} (expected 0, or 1 and why)"
    with _lock:
        state["status"] = "built" if reason is None else "failed"
        state["reason"], state["outcome"] = reason, out.strip()


def _stop_builds() -> None:
    """At exit: stop every build still running (its compiler killed, no temporary file left)."""
    stopped = False
    for build in _builds:
        if build.proc.poll() is not None:
            continue
        stopped |= build.background
        build.let_go()  # the builder kills the compiler's group, removes its temporary file and exits
        if build.thread is not None:
            build.thread.join(STOP_WAIT_S)
        try:
            build.proc.wait(STOP_WAIT_S if build.thread is None else 0.1)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(build.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for tmp in build.library.parent.glob(f"{build.library.stem}.{build.proc.pid}.tmp.so"):
                tmp.unlink(missing_ok=True)
    if stopped:
        print(
            "headspace: stopped the native decoding step's unfinished build at exit (nothing left "
            "behind); `headspace native build` builds it once for all",
            file=sys.stderr,
            flush=True,
        )


def _forget_builds() -> None:
    """In a forked child: drop the parent's ends of the builders' pipes (a build stops when the parent
    goes, not when the last fork does)."""
    for build in _builds:
        if build.watch is not None:
            os.close(build.watch)
            build.watch = None
    _builds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_builds)


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
    """Find the library when it is built already, else start building it in a child process, waited
    for by a background thread (once per process; nothing where it is off, loaded, building or
    failed). A build it starts says so in one line on stderr (once per process) and is stopped when
    the process exits unfinished."""
    global _announced
    if _start(background=True) and not _announced:
        _announced = True
        print(
            f"headspace: building the native decoding step in the background into {cache_dir()} "
            "(a C++ compile, once per machine; `headspace native build` does it up front); decoding "
            "runs in Python meanwhile",
            file=sys.stderr,
            flush=True,
        )


def _start(background: bool) -> bool:
    """:func:`start_build`'s work; whether it started a build."""
    if _op is not None or not enabled():
        return False
    with _lock:
        if _state["status"] != "not built":
            return False
        if sys.platform == "win32":
            _state["status"], _state["reason"] = "failed", "the native step is built on Linux and macOS only"
            return False
        cxx = compiler()
        if cxx is None:
            _state["status"] = "failed"
            _state["reason"] = "no C++ compiler found (set CXX, or install g++ or clang++)"
            return False
        path = library_path(cxx)
        _state["path"] = path
        doubt = _prepare(path)
        if doubt is None and path.is_file():
            doubt = _untrusted(path)
            _state["status"], _state["reason"] = ("built", None) if doubt is None else ("failed", doubt)
            return False
        if doubt is not None:
            _state["status"], _state["reason"] = "failed", doubt
            return False
        try:
            build = _spawn(path, cxx, background)
        except OSError as e:
            _state["status"], _state["reason"] = "failed", f"the build process could not start: {e}"
            return False
        _state["status"] = "building"
        thread = threading.Thread(
            target=_wait_for, args=(_state, build), name="headspace-native-build", daemon=True
        )
        _state["thread"] = build.thread = thread
    thread.start()
    return True


def ready(*, warn: bool = True) -> bool:
    """Whether the op is loaded; loads a finished build (in the calling thread) once it, and every
    folder from the cache root down to it, passes the ownership check. Cheap once loaded. Where the
    build failed, the first call with ``warn`` warns once why (a RuntimeWarning)."""
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
                    "decoding runs the Python step, which gives the same logits, a little slower",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False
        path = Path(str(_state["path"]))
        try:
            doubt = _untrusted(path)  # found or just built: checked where it is loaded
        except OSError as e:
            doubt = f"{path} could not be checked: {e}"
        if doubt is not None:
            _state["status"], _state["reason"] = "failed", doubt
            return False
        try:
            # a namespace registers once per process (a second TORCH_LIBRARY aborts it): load a build
            # only where no library of this process registered the op already
            if not _registered():
                torch.ops.load_library(os.path.realpath(path))  # the file the check resolved
            _op = torch.classes.headspace.DecodeStep
        except (OSError, RuntimeError, AttributeError) as e:
            _state["status"], _state["reason"] = "failed", f"{path} could not be loaded: {e}"
            return False
    return True


def _registered() -> bool:
    """Whether the class ``headspace.DecodeStep`` is registered in this process already."""
    try:
        torch._C._get_custom_class_python_wrapper("headspace", "DecodeStep")
    except RuntimeError:  # "Class headspace.DecodeStep not registered!"
        return False
    return True


def build() -> bool:
    """Build (or load) the library now and wait for it (for another process's build of it too);
    whether it is loaded (:func:`status` says why not)."""
    _start(background=False)
    thread = _state.get("thread")
    if isinstance(thread, threading.Thread):
        thread.join()
    return ready(warn=False)


def new_step() -> torch.ScriptObject:
    """An empty ``torch.classes.headspace.DecodeStep`` (``add_layer``, ``set_final_norm``, ``run``; see
    the source's header and :mod:`headspace.decode.native`). Call only after :func:`ready`."""
    assert _op is not None, "call headspace.kernels.native.ready() first"
    return _op()
