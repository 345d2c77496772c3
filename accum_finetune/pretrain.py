"""The pretrained checkpoint of the default transfer task: `resnet_tiny` trained on digits 0-4.

The default one (`resnet_tiny` at 32 px) ships with the package (`accum_finetune/weights/`), so the job starts from the
same weights on every machine; it is checked by its CRC-32 when loaded (a mismatch: one warning, then the cache below).
Rebuild the shipped file with `python -m accum_finetune.pretrain --ship` (docs/main_job.md: on which machine it was).
Other architectures and sizes are trained at their first run and cached; build (or rebuild) one by hand with
`python -m accum_finetune.pretrain [--arch A] [--size N] [--force]`. The cache folder is `$ACCUM_CALLBACK_CACHE`, else
`$XDG_CACHE_HOME/accum_callback`, else `~/.cache/accum_callback`."""
from __future__ import annotations
import contextlib, io, os, sys
from pathlib import Path

import torch
from fastai.learner import Learner
import fastai.callback.schedule, fastai.callback.progress   # noqa: F401  `fit_one_cycle`, progress bars
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.torch_core import set_seed

from .data import DIGITS_PRETRAIN, digits_dls
from .models import DEFAULT_ARCH, create_model

__all__ = ['CACHE_ENV', 'SHIPPED', 'cache_dir', 'checkpoint_path', 'shipped_path', 'pretrained_checkpoint']

CACHE_ENV = 'ACCUM_CALLBACK_CACHE'
PRETRAIN = dict(epochs=4, bs=32, lr=1e-2, seed=0)   # ~20 s on 2 CPU cores; ~99% accuracy on held-out digits 0-4
_VERSION = 1   # bump when the recipe changes, so stale caches are not reused

SHIPPED = Path(__file__).resolve().parent/'weights'   # the package data: the default checkpoint, its CRC-32 beside it
SHIPPED_KINDS = {(DEFAULT_ARCH, 32)}   # (arch, size) of the checkpoints that ship

def cache_dir()->Path:
    if os.environ.get(CACHE_ENV): return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get('XDG_CACHE_HOME') or Path.home()/'.cache')/'accum_callback'

def _name(arch:str, size:int)->str: return f"{arch}_digits{''.join(map(str, DIGITS_PRETRAIN))}_{size}px_v{_VERSION}.pth"

def checkpoint_path(arch:str=DEFAULT_ARCH, size:int=32)->Path: return cache_dir()/_name(arch, size)

def shipped_path(arch:str=DEFAULT_ARCH, size:int=32)->Path|None:
    "The package's checkpoint of `arch` at `size`, or None where none ships"
    return SHIPPED/_name(arch, size) if (arch, size) in SHIPPED_KINDS else None

def _crc_path(path:Path)->Path: return path.with_name(path.name + '.crc32')

def _whole(path:Path)->bool:
    "Is the cached checkpoint the file that was written (its length and CRC-32 as its `.crc32` beside it says)?"
    import zlib
    try: raw,want = path.read_bytes(),_crc_path(path).read_text().split()
    except OSError: return False
    return len(want) == 2 and want == [f'{zlib.crc32(raw):08x}', str(len(raw))]

def pretrained_checkpoint(arch:str=DEFAULT_ARCH, size:int=32, force:bool=False, progress:bool=False)->Path:
    """Path of the digits 0-4 checkpoint of `arch` at `size`: the shipped one where the package has it and its CRC-32
    matches, else the cache's, training (and caching) it first if it is not there (on the CPU; `force`: trained again
    into the cache). Written as the image cache is (synced, renamed whole, its CRC-32 beside it); one found cut, empty
    or damaged is rebuilt, said in one line"""
    shipped = shipped_path(arch, size)
    if shipped is not None and not force:
        if _whole(shipped): return shipped
        import warnings
        warnings.warn(f"accum-finetune: the shipped pretrained checkpoint {shipped} does not match its CRC-32 (or is "
                      "missing): using the cache folder's instead (reinstall the package to get it back)", stacklevel=2)
    path = checkpoint_path(arch, size)
    if path.is_file() and not force:
        if _whole(path): return path
        print(f"accum-finetune: the cached pretrained checkpoint {path} is damaged, empty or from an older version: "
              "rebuilding it", file=sys.stderr)
    print(f"accum-finetune: pretraining {arch} on digits 0-4 once, cached at {path}", file=sys.stderr)
    _train(arch, size, path, progress)
    return path

def _train(arch:str, size:int, path:Path, progress:bool=False):
    "Train the recipe and write the checkpoint to `path` (synced, renamed whole), its CRC-32 and length beside it"
    import zlib
    from accum_callback.core.files import atomic_write
    set_seed(PRETRAIN['seed'], reproducible=True)
    # fastai's default is the GPU
    dls = digits_dls(PRETRAIN['bs'], DIGITS_PRETRAIN, size, valid_pct=0.1, seed=PRETRAIN['seed']).cpu()
    learn = Learner(dls, create_model(arch, dls.c), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    with learn.no_logging(), (learn.no_bar() if not progress else contextlib.nullcontext()):
        learn.fit_one_cycle(PRETRAIN['epochs'], PRETRAIN['lr'])
        acc = float(learn.validate()[1])
    # Written whole, synced, then renamed (concurrent first runs never read a half-written file), its CRC-32 beside it
    buf = io.BytesIO()
    torch.save(dict(model=learn.model.state_dict(), arch=arch, classes=list(DIGITS_PRETRAIN), size=size,
                    accuracy=acc, recipe=PRETRAIN), buf)
    raw = buf.getvalue()
    with atomic_write(path) as f: f.write(raw)
    with atomic_write(_crc_path(path), 'w') as f: f.write(f'{zlib.crc32(raw):08x} {len(raw)}\n')

def ship()->Path:
    """Rebuild the shipped checkpoint (`python -m accum_finetune.pretrain --ship`): the recipe, in one torch thread on
    the CPU (the same bytes at every rebuild on one machine), written into the package's `weights/` with its CRC-32"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = shipped_path()
        SHIPPED.mkdir(exist_ok=True)
        _train(DEFAULT_ARCH, 32, path)
    finally: torch.set_num_threads(threads)
    return path

if __name__ == '__main__':
    import argparse
    p = argparse.ArgumentParser(prog='python -m accum_finetune.pretrain', description=__doc__.splitlines()[0])
    p.add_argument('--arch', default=DEFAULT_ARCH); p.add_argument('--size', type=int, default=32)
    p.add_argument('--force', action='store_true', help='train again into the cache, even where a checkpoint ships')
    p.add_argument('--ship', action='store_true',
                   help="rebuild the package's shipped checkpoint (the default arch and size)")
    a = p.parse_args()
    if a.ship and (a.arch, a.size) != (DEFAULT_ARCH, 32): p.error(f"--ship: only {DEFAULT_ARCH} at 32 px ships")
    path = ship() if a.ship else pretrained_checkpoint(a.arch, a.size, a.force, progress=True)
    crc = _crc_path(path).read_text().split()
    acc = torch.load(path, weights_only=True)['accuracy']
    print(f"{path} (held-out accuracy {acc:.4f}, CRC-32 {crc[0]}, {crc[1]} bytes)")
