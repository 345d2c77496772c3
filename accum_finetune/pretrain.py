"""The pretrained checkpoint of the default transfer task: `resnet_tiny` trained on digits 0-4, cached after the first run.

Build (or rebuild) it by hand with `python -m accum_finetune.pretrain [--force]`. The cache folder is
`$ACCUM_CALLBACK_CACHE`, else `$XDG_CACHE_HOME/accum_callback`, else `~/.cache/accum_callback`."""
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

__all__ = ['CACHE_ENV', 'cache_dir', 'checkpoint_path', 'pretrained_checkpoint']

CACHE_ENV = 'ACCUM_CALLBACK_CACHE'
PRETRAIN = dict(epochs=4, bs=32, lr=1e-2, seed=0)   # ~20 s on 2 CPU cores; ~99% accuracy on held-out digits 0-4
_VERSION = 1   # bump when the recipe changes, so stale caches are not reused

def cache_dir()->Path:
    if os.environ.get(CACHE_ENV): return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get('XDG_CACHE_HOME') or Path.home()/'.cache')/'accum_callback'

def checkpoint_path(arch:str=DEFAULT_ARCH, size:int=32)->Path:
    return cache_dir()/f"{arch}_digits{''.join(map(str, DIGITS_PRETRAIN))}_{size}px_v{_VERSION}.pth"

def _crc_path(path:Path)->Path: return path.with_name(path.name + '.crc32')

def _whole(path:Path)->bool:
    "Is the cached checkpoint the file that was written (its length and CRC-32 as its `.crc32` beside it says)?"
    import zlib
    try: raw,want = path.read_bytes(),_crc_path(path).read_text().split()
    except OSError: return False
    return len(want) == 2 and want == [f'{zlib.crc32(raw):08x}', str(len(raw))]

def pretrained_checkpoint(arch:str=DEFAULT_ARCH, size:int=32, force:bool=False, progress:bool=False)->Path:
    """Path of the digits 0-4 checkpoint of `arch`, training (and caching) it first if it is not there (on the CPU).
    Written as the image cache is (synced, renamed whole, its CRC-32 beside it); one found cut, empty or damaged is
    rebuilt, said in one line"""
    import zlib
    from accum_callback.core.files import atomic_write
    path = checkpoint_path(arch, size)
    if path.is_file() and not force:
        if _whole(path): return path
        print(f"accum-finetune: the cached pretrained checkpoint {path} is damaged, empty or from an older version: "
              "rebuilding it", file=sys.stderr)
    set_seed(PRETRAIN['seed'], reproducible=True)
    dls = digits_dls(PRETRAIN['bs'], DIGITS_PRETRAIN, size, valid_pct=0.1, seed=PRETRAIN['seed']).cpu()   # fastai's default is the GPU
    learn = Learner(dls, create_model(arch, dls.c), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    print(f"accum-finetune: pretraining {arch} on digits 0-4 once, cached at {path}", file=sys.stderr)
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
    return path

if __name__ == '__main__':
    import argparse
    p = argparse.ArgumentParser(prog='python -m accum_finetune.pretrain', description=__doc__.splitlines()[0])
    p.add_argument('--arch', default=DEFAULT_ARCH); p.add_argument('--size', type=int, default=32)
    p.add_argument('--force', action='store_true', help='rebuild even if cached')
    a = p.parse_args()
    path = pretrained_checkpoint(a.arch, a.size, a.force, progress=True)
    print(f"{path} (held-out accuracy {torch.load(path, weights_only=True)['accuracy']:.4f})")
