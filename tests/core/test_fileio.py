"""fileio: atomic writes with the usual modes (the umask decides), and the bounded regular-file reader."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from headspace.core.fileio import (
    UnsafeFileError,
    make_temp_dir,
    parse_json,
    read_regular_file,
    write_atomic,
    write_json,
)


@pytest.fixture(params=[(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)], ids=["umask022", "umask077"])
def umask(request: pytest.FixtureRequest) -> Iterator[tuple[int, int]]:
    """Run under a umask, yield the (file, folder) modes it implies, and restore the previous umask."""
    mask, file_mode, dir_mode = request.param
    previous = os.umask(mask)
    try:
        yield file_mode, dir_mode
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_get_0666_filtered_by_the_umask(tmp_path: Path, umask: tuple[int, int]) -> None:
    file_mode, dir_mode = umask
    new = write_atomic(tmp_path / "a.txt", "one")
    assert new.read_text() == "one" and _mode(new) == file_mode
    old = tmp_path / "b.bin"
    old.write_bytes(b"before")
    old.chmod(0o600)
    write_atomic(old, b"after")  # replacing a file writes a new one, with the usual mode
    assert old.read_bytes() == b"after" and _mode(old) == file_mode
    j = write_json(tmp_path / "sub" / "dir" / "c.json", {"x": 1})
    assert _mode(j) == file_mode and _mode(tmp_path / "sub" / "dir") == dir_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "sub"]  # no temporary left


def test_temporary_folders_get_0777_filtered_by_the_umask(tmp_path: Path, umask: tuple[int, int]) -> None:
    _, dir_mode = umask
    first = make_temp_dir(tmp_path, prefix=".step-000001.")
    second = make_temp_dir(tmp_path, prefix=".step-000001.")
    assert first != second and first.name.startswith(".step-000001.") and first.name.endswith(".tmp")
    assert _mode(first) == dir_mode and _mode(second) == dir_mode


def test_a_failed_write_leaves_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = write_atomic(tmp_path / "keep.txt", "before")

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "after")
    assert target.read_text() == "before" and sorted(os.listdir(tmp_path)) == ["keep.txt"]


@pytest.fixture()
def alarm() -> Iterator[None]:
    def hung(*_: object) -> None:
        raise TimeoutError("the reader blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_only_regular_files_within_the_cap_are_read(tmp_path: Path, alarm: None) -> None:
    ok = tmp_path / "ok.bin"
    ok.write_bytes(b"x" * 10)
    assert read_regular_file(ok, max_bytes=10) == b"x" * 10
    with pytest.raises(UnsafeFileError, match=r"ok\.bin: 10 bytes, more than the 9 bytes allowed"):
        read_regular_file(ok, max_bytes=9)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeFileError, match=r"pipe: a named pipe \(FIFO\), not a regular file"):
        read_regular_file(fifo, max_bytes=100)  # refused before open: never blocks
    with pytest.raises(UnsafeFileError, match=r"a character device, not a regular file"):
        read_regular_file("/dev/zero", max_bytes=100)
    link = tmp_path / "link"
    link.symlink_to(ok)
    assert read_regular_file(link, max_bytes=10) == b"x" * 10
    with pytest.raises(UnsafeFileError, match=r"link: a symbolic link \(to .*ok\.bin\), not a regular file"):
        read_regular_file(link, max_bytes=10, follow_symlinks=False)
    with pytest.raises(UnsafeFileError, match="a folder, not a regular file"):
        read_regular_file(tmp_path, max_bytes=10)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "absent", max_bytes=10)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"[" * 33 + b"]" * 33, "nested more than 32 levels deep"),
        (b"[" * 100_000 + b"]" * 100_000, "nested more than 32 levels deep"),  # past Python's recursion limit
        (b'{"lr": NaN}', "NaN is not JSON"),
        (b'{"lr": -Infinity}', "-Infinity is not JSON"),
        (b"\xff{}", "not UTF-8"),
        (b'{"a": ', "Expecting value"),
    ],
)
def test_parse_json_refuses_deep_nesting_and_non_json(data: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_json(data)


def test_parse_json_reads_ordinary_json() -> None:
    assert parse_json(b'{"a": [1, 2.5, {"b": null}], "c": "d"}') == {"a": [1, 2.5, {"b": None}], "c": "d"}
    assert parse_json(b"[" * 32 + b"]" * 32) is not None
