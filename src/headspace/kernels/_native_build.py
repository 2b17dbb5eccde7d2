"""The child process that builds the native decoding step (started by :mod:`headspace.kernels.native`).

Run as a script (``python -I _native_build.py --watch FD --timeout S [--nice N] LIBRARY -- COMMAND...``,
standard library only, so that it starts without importing torch). Its contract:

* With ``--nice N`` (N > 0) it first lowers its own priority by N (``os.nice``); the compiler it starts
  inherits it.

* It holds an exclusive ``fcntl.flock`` on ``LIBRARY`` with the suffix ``.lock`` while it builds, so
  a second builder of the same library waits, then finds it built. The kernel drops the lock when the
  holder dies, however it dies: no stale lock is left to wait on.
* It compiles with ``COMMAND`` (the argument ``@OUT@`` replaced by a temporary name beside
  ``LIBRARY``), in a process group of the compiler's own, then makes the result not writable by group
  or others and renames it to ``LIBRARY`` (atomic).
* ``FD`` is the read end of a pipe whose write end only the parent holds: when the parent exits,
  however it exits, the read end sees end-of-file, and the builder kills the compiler's whole group
  (driver, cc1plus, linker), waits until none of it is left and removes the temporary file before it
  exits. It does the same past ``S`` seconds, on SIGTERM and on any error of its own.
* Under the lock it first removes temporary files a killed builder of the same library left, and
  those of other versions older than ``S`` seconds.
* It says how it went: exit 0 and ``compiled`` or ``found`` on stdout (the library is there); exit 1
  and one line on stderr (why it failed); exit 3 (the parent went away: stopped, nothing left).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = "@OUT@"
"""The argument of the compiler command that stands for the output file."""
MARKER = "HEADSPACE_NATIVE_BUILD"
"""Set to the library's path in the compiler's environment (inherited by every process it starts)."""
PARENT_GONE, FAILED = 3, 1


class _Stop(Exception):
    """The build is to stop: the parent went away, or SIGTERM."""


def _parent_gone(fd: int, wait_s: float) -> bool:
    """Whether the parent's end of the pipe closed (waits up to ``wait_s`` seconds for it)."""
    ready, _, _ = select.select([fd], [], [], wait_s)
    return bool(ready) and os.read(fd, 1) == b""


def _lock(lock_path: Path, watch: int, deadline: float) -> int:
    """The lock file's descriptor, exclusively locked (waits for another builder to let go)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
        if _parent_gone(watch, 0.1):
            raise _Stop
        if time.monotonic() > deadline:
            raise TimeoutError(f"another build of {lock_path.stem} held {lock_path} past the time limit")


def _remove_stale(library: Path, timeout_s: float) -> None:
    """Temporary files a killed builder left: this library's (we hold its lock), and other versions'
    older than the time limit."""
    now = time.time()
    family = library.stem.rsplit("_", 1)[0]  # headspace_decode_rows
    for tmp in library.parent.glob(f"{family}_*.tmp.so"):
        try:
            if tmp.name.startswith(library.stem + ".") or now - tmp.stat().st_mtime > timeout_s:
                tmp.unlink()
        except FileNotFoundError:
            pass


def _become_subreaper() -> bool:
    """On Linux, adopt the orphans of the compiler's tree (a cc1plus whose driver was killed), so
    that they are reaped here at once rather than whenever init gets to it; whether it did."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _kill_group(proc: subprocess.Popen[bytes], subreaper: bool) -> None:
    """Kill the compiler's process group and wait until none of its processes is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if subreaper:  # every process of the tree is a child here once its parent is gone
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    time.sleep(0.01)
                continue
            os.killpg(proc.pid, 0)  # any member (a cc1plus the driver left) still there?
        except (ChildProcessError, ProcessLookupError):
            return
        time.sleep(0.02)


def _compile(
    library: Path, command: list[str], watch: int, deadline: float, timeout_s: float, subreaper: bool
) -> str:
    """Compile into a temporary file, then rename it to ``library``; "compiled" (raises otherwise)."""
    tmp = library.parent / f"{library.stem}.{os.getpid()}.tmp.so"
    log = tempfile.TemporaryFile()  # the compiler's messages, gone when closed
    env = {**os.environ, MARKER: str(library)}
    argv = [str(tmp) if a == OUT else a for a in command]
    proc = None
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
        )
        while proc.poll() is None:
            if _parent_gone(watch, 0.1):
                raise _Stop
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv[0]} ran past the time limit of {timeout_s:g} s")
        if proc.returncode != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            said = " / ".join(tail) or "(no output)"
            raise RuntimeError(f"{argv[0]} exited with {proc.returncode}: {said}")
        os.chmod(tmp, 0o755)  # not writable by group or others, whatever the umask
        os.replace(tmp, library)
        return "compiled"
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc, subreaper)
        log.close()
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="_native_build")
    parser.add_argument("--watch", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("library", type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    def stop(signum: int, frame: object) -> None:
        raise _Stop

    if args.nice > 0:
        try:
            os.nice(args.nice)  # before the compiler starts: it inherits the lower priority
        except OSError:
            pass  # (lowering one's own priority is always allowed; a platform without it builds as is)
    signal.signal(signal.SIGTERM, stop)  # (in a session of its own, no terminal's Ctrl-C reaches it)
    deadline = time.monotonic() + args.timeout
    library: Path = args.library
    subreaper = _become_subreaper()
    try:
        lock = _lock(library.with_suffix(".lock"), args.watch, deadline)
        try:
            if library.is_file():
                outcome = "found"
            else:
                _remove_stale(library, args.timeout)
                outcome = _compile(library, command, args.watch, deadline, args.timeout, subreaper)
        finally:
            os.close(lock)  # lets the next builder in
    except _Stop:
        return PARENT_GONE
    except Exception as e:
        print(str(e).replace("\n", " / ") or type(e).__name__, file=sys.stderr)
        return FAILED
    print(outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
