"""Files that survive a cut: one way to write them (a temporary file beside the target, flushed and synced, renamed over
it, the folder synced), so that a write cut at any byte leaves the last good file in place, never a part of a new one.
Used by the checkpoints, and by the job for its image cache, metrics.json and the exported model."""
from __future__ import annotations
import contextlib, os, tempfile
from pathlib import Path

__all__ = ['atomic_write', 'replace_durably', 'fsync_dir']

def fsync_dir(folder):
    "Make a rename in `folder` durable (a no-op where folders cannot be opened, e.g. Windows)"
    try: fd = os.open(str(folder), os.O_RDONLY)
    except OSError: return
    try: os.fsync(fd)
    except OSError: pass
    finally: os.close(fd)

def replace_durably(tmp, dest):
    "Sync the written file `tmp` to disk, rename it over `dest`, sync the folder: after a power loss `dest` is whole, old or new"
    with open(tmp, 'rb+') as f: os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync_dir(Path(dest).parent)

@contextlib.contextmanager
def atomic_write(path, mode:str='wb', perms:int|None=None):
    """Open a temporary file beside `path` for writing; when the block ends without an error it is flushed, synced to
    disk and renamed over `path` (then the folder is synced): readers see the old file or the whole new one. After an
    error (or a kill) the temporary file is removed, or, where the process died, left with a `.part` name that nothing
    reads. `perms`: the file's mode bits (default: what the umask gives a new file)"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd,tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.', suffix=f'.{os.getpid()}.part')
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush(); os.fsync(f.fileno())
        if perms is None:
            um = os.umask(0); os.umask(um)
            perms = 0o666 & ~um
        os.chmod(tmp, perms)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError): os.remove(tmp)
        raise
