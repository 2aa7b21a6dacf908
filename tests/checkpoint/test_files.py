"""fairseq_oss/checkpoint/files.py: copies that are independent files, temporaries that only their
own writer's death makes removable, and a writer whose abort never hides the error."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fairseq_oss.checkpoint.files import TemporaryFile, clone_or_copy, remove_stale_temporaries


def write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_copy_is_an_independent_file_and_never_writes_through(tmp_path):
    """dst was a hard link to an older checkpoint (as fairseq-oss 0.1 made them): copying
    over it replaces the name and leaves the older checkpoint's bytes as they were; and
    writing the copy in place afterwards changes neither other file."""
    src, dst, older = tmp_path / "checkpoint_3.pt", tmp_path / "checkpoint_last.pt", tmp_path / "checkpoint_2.pt"
    payload = os.urandom(3 << 20) + b"tail"
    write(src, payload)
    write(older, b"older checkpoint")
    os.link(older, dst)
    how = clone_or_copy(str(src), str(dst))
    assert how in ("reflink", "copy")
    assert read(dst) == payload and read(older) == b"older checkpoint"
    assert len({os.stat(p).st_ino for p in (src, dst, older)}) == 3
    write(dst, b"written in place, as torch.save(obj, name) does")
    assert read(src) == payload and read(older) == b"older checkpoint"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_copy_of_a_missing_source_leaves_nothing(tmp_path):
    write(tmp_path / "checkpoint_last.pt", b"previous")
    with pytest.raises(FileNotFoundError):
        clone_or_copy(str(tmp_path / "missing.pt"), str(tmp_path / "checkpoint_last.pt"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_last.pt"]
    assert read(tmp_path / "checkpoint_last.pt") == b"previous"


LIVE_WRITER = textwrap.dedent(
    """
    import sys, time
    from fairseq_oss.checkpoint.files import TemporaryFile
    t = TemporaryFile(sys.argv[1])
    t.file.write(b"being written"); t.file.flush()
    print(t.path, flush=True)
    time.sleep(600)
    """
)


def test_only_temporaries_of_dead_writers_are_removed(tmp_path):
    """Another run's live writer (another process, same directory) keeps its temporary;
    once that process is gone, the temporary is removed. Files that only look similar,
    and this process's own live temporary, are left alone."""
    proc = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        theirs = proc.stdout.readline().strip()
        assert os.path.exists(theirs)
        mine = TemporaryFile(str(tmp_path))
        write(tmp_path / ".fairseq-oss-notes.txt", b"not a temporary")
        assert remove_stale_temporaries(str(tmp_path)) == []
        assert os.path.exists(theirs) and os.path.exists(mine.path)
    finally:
        proc.kill()
        proc.wait()
    assert remove_stale_temporaries(str(tmp_path)) == [os.path.basename(theirs)]
    assert os.path.exists(mine.path) and os.path.exists(tmp_path / ".fairseq-oss-notes.txt")
    mine.discard()
    assert sorted(os.listdir(tmp_path)) == [".fairseq-oss-notes.txt"]


def test_temporary_commit_is_durable_and_replaces_the_name_only(tmp_path):
    write(tmp_path / "a.pt", b"A")
    os.link(tmp_path / "a.pt", tmp_path / "b.pt")
    t = TemporaryFile(str(tmp_path))
    t.file.write(b"B")
    t.commit(str(tmp_path / "b.pt"))
    assert read(tmp_path / "b.pt") == b"B" and read(tmp_path / "a.pt") == b"A"
    assert t.file.closed


def test_writer_abort_lets_the_original_error_surface(tmp_path):
    """A collective that fails while a record is being streamed (a rank killed, Ctrl-C):
    the writer's abort neither raises nor hides it, closes the file and removes it."""
    from fairseq_oss.checkpoint.format import CheckpointWriter

    writer = CheckpointWriter(str(tmp_path))
    with pytest.raises(ConnectionError, match="peer rank 1 went away"):
        try:
            with writer.stream("data/0") as out:
                out.write(torch.arange(1000, dtype=torch.float32))
                raise ConnectionError("peer rank 1 went away")
        except BaseException:
            writer.abort()
            raise
    assert writer._file.closed
    assert os.listdir(tmp_path) == []


def test_a_failed_record_write_is_not_recorded_and_abort_is_quiet(tmp_path, monkeypatch):
    """A write that fails (a full disk) leaves the record out of the manifest; the abort
    that follows is silent."""
    from fairseq_oss.checkpoint.format import CheckpointWriter

    writer = CheckpointWriter(str(tmp_path))
    with writer.stream("data/0") as out:
        out.write(b"complete")
    with pytest.raises(OSError, match="No space left"):
        with writer.stream("data/1") as out:
            monkeypatch.setattr(out._out._fileobj, "write", _enospc)
            out.write(b"never lands")
    assert list(writer.records) == ["data/0"]
    writer.abort()
    assert os.listdir(tmp_path) == []


def _enospc(data):
    raise OSError(28, "No space left on device")


def test_temporary_gets_the_mode_open_would_give(tmp_path):
    """0o666 less the umask, as any file the user's programs create (never 0o666 as such)."""
    old = os.umask(0o027)
    try:
        t = TemporaryFile(str(tmp_path))
    finally:
        os.umask(old)
    assert os.stat(t.path).st_mode & 0o777 == 0o640
    t.discard()


def test_a_temporary_never_creates_its_directory_and_names_it_in_errors(tmp_path):
    from fairseq_oss.checkpoint.files import TemporaryFile

    missing = str(tmp_path / "no" / "such")
    with pytest.raises(FileNotFoundError) as e:
        TemporaryFile(missing)
    assert e.value.filename == missing and not os.path.exists(tmp_path / "no")
