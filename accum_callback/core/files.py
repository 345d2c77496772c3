"""Files that survive a cut: one way to write them (a temporary file beside the target, flushed and synced, renamed over
it, the folder synced), so that a write cut at any byte leaves the last good file in place, never a part of a new one.
Used by the checkpoints, and by the job for its image cache, metrics.json and the exported model."""
from __future__ import annotations
import contextlib, os, re, tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

__all__ = ['serials', 'remove_old', 'Background', 'new_file_perms', 'atomic_write', 'replace_durably', 'fsync_dir',
           'writable_folder', 'remove_stale_parts', 'keep_copy']

def fsync_dir(folder):
    "Make a rename in `folder` durable (a no-op where folders cannot be opened, e.g. Windows)"
    try: fd = os.open(str(folder), os.O_RDONLY)
    except OSError: return
    try: os.fsync(fd)
    except OSError: pass
    finally: os.close(fd)

def replace_durably(tmp, dest):
    """Sync the written file `tmp` to disk, rename it over `dest`, sync the folder: after a power loss `dest` is whole,
    old or new"""
    with open(tmp, 'rb+') as f: os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync_dir(Path(dest).parent)

def serials(folder, prefix:str, suffix:str)->list:
    "The serial numbers of the files `<prefix><serial>.rank<r><suffix>` in `folder` (any rank's), sorted"
    pat = re.compile(re.escape(prefix) + r'(\d+)\.rank\d+' + re.escape(suffix))
    return sorted({int(m.group(1)) for f in Path(folder).glob(f'{prefix}*.rank*{suffix}')
                   if (m := pat.fullmatch(f.name))})

def remove_old(serials:list, keep:int, remove)->list:
    """`remove(s)` for all but the newest `keep` of the sorted `serials`; `(serial, error)` for each that raised an
    `OSError`"""
    failed = []
    for s in serials[:-keep]:
        try: remove(s)
        except OSError as e: failed.append((s, e))
    return failed

def new_file_perms()->int:
    """The mode bits a new file gets from the umask (read here, in the thread that writes nothing: the umask is the
    process's)"""
    um = os.umask(0); os.umask(um)
    return 0o666 & ~um

class Background:
    """One job at a time in a thread that lives from the first job to `close()` (a checkpoint's file written while
    training goes on): `start(fn)` waits for the one before, `wait()` returns what the last one returned and the
    exception it raised (or None). One thread for all of a fit's jobs: starting a thread a job cost the caller more
    than a millisecond on 2 cores (the new thread holds the GIL until it blocks or its switch interval ends)"""
    def __init__(self): self._pool,self._job = None,None
    def __getstate__(self): return {}   # (a Learner pickled with its callbacks: no thread in it, and an older one's
    def __setstate__(self, d): self.__init__()   # `Background` read back idle)
    def start(self, fn, now:bool=False):
        "Run `fn` in the thread once the job before it is done, or (`now`: a job waited for at once) here, without one"
        self.wait()
        if now:
            self._job = Future()
            try: self._job.set_result(fn())
            except BaseException as e: self._job.set_exception(e)
            return
        if self._pool is None: self._pool = ThreadPoolExecutor(1, thread_name_prefix='accum_callback-writer')
        self._job = self._pool.submit(fn)
    def wait(self)->tuple:
        job,self._job = self._job,None
        if job is None: return None,None
        try: return job.result(),None
        except BaseException as e: return None,e
    def close(self)->tuple:
        "Wait for the job in flight, then end the thread"
        out = self.wait()
        if self._pool is not None: self._pool.shutdown(); self._pool = None
        return out

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
        os.chmod(tmp, new_file_perms() if perms is None else perms)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError): os.remove(tmp)
        raise

def writable_folder(folder, what:str, holds:str):
    "`ValueError` naming `what` unless `folder` is a folder (created if missing) this process can write in"
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what} {folder} is a file, not a folder: give a folder for {holds} (it is created if "
                         "missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd,probe = tempfile.mkstemp(dir=folder, prefix='.write-check.', suffix='.part')
        os.close(fd); os.remove(probe)
    except OSError as e:
        raise ValueError(f"{what.split('`')[0]}cannot write in `{what.split('`')[1]}` {folder} ({type(e).__name__}: "
                         f"{e.strerror or e}): give a folder this process can write to") from None

def _running(pid:int)->bool:
    try: os.kill(pid, 0)
    except ProcessLookupError: return False
    except OSError: return True   # (another user's: running)
    return True

def remove_stale_parts(folder, prefix:str)->list:
    """Remove what `atomic_write` left in `folder` for files named `prefix*` when its process died
    (`.<name>.<random>.<pid>.part`, the process no longer running); nothing else. Returns the names removed"""
    import re
    out = []
    for f in Path(folder).glob(f'.{prefix}*.part'):
        m = re.fullmatch(rf'\.{re.escape(prefix)}.*\.(\d+)\.part', f.name)
        if m and f.is_file() and not _running(int(m.group(1))):
            with contextlib.suppress(OSError): f.unlink(); out.append(f.name)
    return out

def keep_copy(src, dest)->OSError|None:
    """`dest` made a durable copy of the whole file `src` (a hard link where the folder allows: no second copy on disk),
    replacing an older `dest` atomically; the error where it cannot be (nothing is left half-written), else None"""
    import shutil
    src,dest = Path(src),Path(dest)
    tmp = dest.with_name(f'.{dest.name}.{os.getpid()}.part')
    try:
        with contextlib.suppress(FileNotFoundError): tmp.unlink()
        try: os.link(src, tmp)
        except OSError: shutil.copyfile(src, tmp)
        replace_durably(tmp, dest)
    except OSError as e:
        with contextlib.suppress(OSError): tmp.unlink()
        return e
    return None
