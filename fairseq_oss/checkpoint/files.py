"""Writing users' files safely: temporaries, durable commits, independent copies.

Owns every file this package creates, and the rules it keeps with them:

* a file is written under a temporary name in its target's directory and only renamed
  to its final name once complete and fsync'd (:class:`TemporaryFile`, :func:`commit`);
  a final name never shows a partial file, and never is a file written *through* (a
  rename replaces the name; whatever file the old name was, hard-linked or not, is left
  as it was);
* a temporary is locked (``flock``) by its writer for as long as the writer lives, so
  :func:`remove_stale_temporaries` removes only temporaries whose writer is proven gone,
  never a live one of another run sharing the directory;
* a copy of a checkpoint under another name (``checkpoint_last.pt``, ``checkpoint_best.pt``)
  is an independent file (:func:`clone_or_copy`): a reflink where the file system has
  them (the blocks are shared until either file is written, and a write to one never
  changes the other), else a copy made in the kernel. Never a hard link: every program
  that writes a file in place (``torch.save(obj, name)``, ``shutil.copyfile``) would write
  through it into the user's other checkpoints.

Nothing here knows about checkpoints' contents, torch or fairseq.
"""
import errno
import fcntl
import os
import shutil
import uuid

PREFIX = ".fairseq-oss-"
SUFFIX = ".tmp"
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_COPY_CHUNK = 1 << 30


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp_path: str, path: str) -> None:
    """Rename a fully written, fsync'd file to ``path`` and make the rename durable."""
    os.replace(tmp_path, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


class TemporaryFile:
    """A new, empty, locked file ``.fairseq-oss-<random>.tmp`` in ``directory``, open for
    writing (``self.file``). :meth:`commit` makes it ``path``, durably; :meth:`discard`
    removes it. Either closes it and releases the lock; a process that dies holding one
    releases the lock with it, which is how :func:`remove_stale_temporaries` knows.

    Raises:
        OSError: naming ``directory``, when it is missing or not writable (or the file
            system refuses locks: ENOLCK). It is never created here.
    """

    def __init__(self, directory: str):
        while True:
            path = os.path.join(directory, f"{PREFIX}{uuid.uuid4().hex}{SUFFIX}")
            # 0o666 less the process's umask (the kernel applies it), as open() would
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except OSError as e:  # said of the directory: the temporary's name means nothing to a user
                raise type(e)(e.errno, e.strerror, directory) from None
            # A cleaner may have locked (and removed) it between our create and our lock:
            # keep it only if we hold the lock and the name is still this file.
            if _try_lock(fd) and _same_file(fd, path):
                break
            os.close(fd)
        self.path = path
        self.file = os.fdopen(fd, "wb")

    def fsync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def commit(self, path: str) -> None:
        """fsync, close, rename to ``path``, fsync the directory."""
        self.fsync()
        commit(self.path, path)
        self.file.close()

    def discard(self) -> None:
        """Close and remove (if the name is still this file). Never raises."""
        try:
            if not self.file.closed and _same_file(self.file.fileno(), self.path):
                os.remove(self.path)
        except OSError:
            pass
        finally:
            try:
                self.file.close()
            except OSError:
                pass


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def remove_stale_temporaries(directory: str) -> list:
    """Remove the temporaries in ``directory`` whose writer is gone (their lock can be
    taken); a live writer's, this run's or another's, is left alone. Returns the names
    removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, a link, or not ours to open
        try:
            if _try_lock(fd) and _same_file(fd, path):
                os.remove(path)
                removed.append(name)
        except OSError:
            pass  # no locks on this file system: the writer cannot be proven gone
        finally:
            os.close(fd)
    return removed


def _clone(src_fd: int, dst_fd: int) -> bool:
    try:
        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
        return True
    except OSError:
        return False


def _kernel_copy(src_fd: int, dst_fd: int, size: int) -> None:
    """copy_file_range: in the kernel (a server-side copy on NFS 4.2 and SMB, a
    reflink on some file systems); falls back to a plain read/write copy."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src_fd, dst_fd, min(_COPY_CHUNK, size - done), done, done)
            if n == 0:
                break
            done += n
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            raise
    if done < size:
        with open(src_fd, "rb", closefd=False) as s, open(dst_fd, "wb", closefd=False) as d:
            s.seek(done)
            d.seek(done)
            shutil.copyfileobj(s, d, 16 << 20)


def clone_or_copy(src: str, dst: str) -> str:
    """Make ``dst`` an independent file with ``src``'s bytes, atomically and durably:
    a reflink where the file system supports one, else a kernel copy, into a temporary
    in ``dst``'s directory, then renamed over ``dst`` (never written through: if ``dst``
    was a hard link to another checkpoint, that checkpoint keeps its bytes). Returns
    ``"reflink"`` or ``"copy"``."""
    tmp = TemporaryFile(os.path.dirname(os.path.abspath(dst)))
    try:
        with open(src, "rb") as s:
            size = os.fstat(s.fileno()).st_size
            how = "reflink" if _clone(s.fileno(), tmp.file.fileno()) else "copy"
            if how == "copy":
                _kernel_copy(s.fileno(), tmp.file.fileno(), size)
        tmp.commit(dst)
    except BaseException:
        tmp.discard()
        raise
    return how
