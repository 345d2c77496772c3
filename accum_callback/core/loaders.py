"""The training loader as the package reads it, whatever cuts it: read one batch ahead (`ReadAhead`: is this the epoch's
last batch?), its place kept for a checkpoint between micro-batches (`Feed`: the batch read ahead; batches left out of
a resumed pass, unloaded where the loader can), its batch sizes, a copy of it in an order of its own (`own_loader`, for
the check, the noise scale and the recomputed BatchNorm statistics), and where the model is. Used by the core, by
`MicroBatching` and by `Checkpoint` alike (it was `micro/loader.py`'s, which re-exports it)."""
from __future__ import annotations
import math, random

import torch

from ..compat.fastai import copy_loader, torch_loader

__all__ = ['Feed', 'FeedLoader', 'ReadAhead', 'feed_of', 'piece_of', 'is_last_batch', 'inner_loader', 'with_last',
           'can_skip',
           'batch_sizes', 'model_device', 'own_loader']

def batch_sizes(dl)->list:
    """The loader's batch sizes in an epoch, where it says (fastai's `n`, `bs`, `drop_last`), else `bs` each. fastai's
    `DistributedDL` counts what each rank really reads (its `len` is the whole loader's over the world, often one
    more)"""
    inner,world = getattr(dl, 'dl', None),getattr(dl, 'world_size', None)
    if (type(dl).__name__ == 'DistributedDL' and getattr(inner, 'n', None) is not None and world
            and getattr(dl, 'bs', None)):
        n,bs = math.ceil(inner.n/world),dl.bs   # every rank reads the padded share of the set
        nb = n//bs if dl.drop_last else math.ceil(n/bs)
    else: n,bs,nb = getattr(dl, 'n', None),getattr(dl, 'bs', None),len(dl)
    if n is None or not bs: return [bs or 1]*nb
    return [min(bs, n - i*bs) for i in range(nb)]

class Feed:
    """The training loader's batches as fetched, for a checkpoint taken between micro-batches (`resume.checkpoint`):
    `ahead` is the batch read ahead (a reference: nothing is copied). To resume, `skip` loader batches are left out of
    the next pass and `first`, the batch the interrupted run had read ahead, comes before them; `then()` runs once the
    loader has drawn the pass's order and left those batches out (the resumed RNG states go in there: the loader draws
    its order from the epoch's start, the batches after it draw as in the interrupted run). A fastai loader without
    worker processes leaves them out unloaded (its indices cut); one with workers, or any other loader, makes them
    again and drops them, so that each worker's RNG stream follows the batches it makes as in the interrupted run"""
    def __init__(self): self.ahead,self.skip,self.first,self.then = None,0,None,None
    def __call__(self, dl):
        skip,first,then,self.skip,self.first,self.then = self.skip,self.first,self.then,0,None,None
        drop = skip if skip and (_workers(dl) or not can_skip(dl)) else 0
        undo = _skip_batches(dl, skip, then) if skip and not drop else None
        if drop == 0 and undo is None and then is not None: then()
        if first is not None and not drop: self.ahead = first; yield first
        for b in dl:
            if undo is not None: undo(); undo = None
            if drop:
                drop -= 1
                if drop == 0:
                    if then is not None: then()
                    if first is not None: self.ahead = first; yield first
                continue
            self.ahead = b; yield b
        if undo is not None: undo()
        self.ahead = None

def _workers(dl)->bool:
    "Does `dl` load in worker processes?"
    return (getattr(dl, 'num_workers', 0) or 0) > 0

def _skip_batches(dl, k:int, then=None):
    """Leave the first `k` batches out of `dl`'s next pass, unloaded: its indices, as fastai's loaders (and
    `DistributedDL`, a rank's share) draw them, less the first `k` batches' worth (once: the next pass is whole);
    `then()` once they are drawn. Returns what to undo once the pass has started"""
    orig = dl.get_idxs
    def get_idxs():
        dl.__dict__.pop('get_idxs', None)
        idxs = list(orig())[k*dl.bs:]
        if then is not None: then()
        return idxs
    dl.get_idxs = get_idxs
    # torch's loader iterator draws a seed from the global RNG when it starts: the interrupted run drew it at the
    # epoch's start (the RNG states saved include it), so the resumed pass draws it from a generator of its own
    fake = torch_loader(dl)
    if fake is None or not hasattr(fake, 'generator'): return None
    old,fake.generator = fake.generator,torch.Generator()
    def undo(): fake.generator = old
    return undo

def can_skip(dl)->bool:
    "Can `dl` leave batches out of a pass unloaded (`Feed.skip`)?"
    return hasattr(dl, 'get_idxs') and bool(getattr(dl, 'bs', None))

def with_last(it):
    """Yield `(item, is_last)` of an iterable: its end is where its iterator ends, whatever its `len` says (one item
    read ahead)"""
    it = iter(it)
    try: cur = next(it)
    except StopIteration: return
    for nxt in it:
        yield cur,False
        cur = nxt
    yield cur,True

class FeedLoader:
    """The protocol of the loaders the package puts over the training loader (`ReadAhead`, `MicroBatches`), read only
    through `feed_of`, `piece_of`, `is_last_batch` and `inner_loader`: `dl`, the loader it reads; `feed`, the place of
    the batches fetched (`Feed`); `piece`, the piece of a loader batch being run (None: its batches run whole); `last`,
    whether the batch being run is the epoch's last (where its batches run whole)"""
    piece,last = None,False
    def __init__(self, dl): self.dl,self.feed = dl,Feed()

def feed_of(dl)->Feed|None:
    "The place of `dl`'s batches fetched (`Feed`), where the package's loader runs it, else None"
    return dl.feed if isinstance(dl, FeedLoader) else None
def piece_of(dl):
    "The piece of a loader batch `dl` runs (`MicroBatches`), else None (its batches run whole)"
    return dl.piece if isinstance(dl, FeedLoader) else None

def is_last_batch(dl)->bool|None:
    """Is the loader batch being run the epoch's last (its piece's, where `dl` cuts it)? None for a loader not the
    package's"""
    if not isinstance(dl, FeedLoader): return None
    return dl.piece.last_batch if dl.piece is not None else dl.last

def inner_loader(dl):
    "The loader `dl` reads: the package's (`FeedLoader`) or fastai's `DistributedDL`'s, one level down, else `dl`"
    return dl.dl if isinstance(dl, FeedLoader) else dl.__dict__.get('dl', dl)

class ReadAhead(FeedLoader):
    """The training loader read one batch ahead, so that `last` tells whether the batch being run is the epoch's last
    (fastai's loop knows only `len`, which a loader such as `DistributedDL`, a custom sampler or an iterable dataset can
    overstate). Everything else is the real loader's. It holds one more batch than fastai does"""
    # (its batches run whole: `MicroBatching`'s loader says which piece runs; not the real loader's, if it has one)
    piece = None
    def __getattr__(self, k):
        if k in ('dl', 'feed'): raise AttributeError(k)
        return getattr(self.dl, k)
    def __len__(self)->int: return len(self.dl)
    def __iter__(self):
        self.last = False
        for b,self.last in with_last(self.feed(self.dl)): yield b

def model_device(model)->torch.device:
    "Where `model`'s parameters are (the CPU for a model without any)"
    return next(iter(model.parameters()), torch.empty(0)).device

def own_loader(learn, shuffle:bool=False, seed:int=0, drop_last:bool|None=None):
    """A copy of the training loader in an order of its own, for the check, the noise scale and the recomputed BatchNorm
    statistics: the loader's order, or shuffled from `seed` (dropping an incomplete last batch as training does, unless
    `drop_last`); the Learner's loader and its RNG are not touched. A loader of ready-made batches (`bs=None`) has no
    incomplete batch to drop; one that cannot copy itself is read in its own order, from a copy"""
    dl = learn.dls.train
    if not hasattr(dl, 'new'): return dl
    # (fastai refuses it at bs=None)
    drop = (shuffle if drop_last is None else drop_last) and bool(getattr(dl, 'bs', None))
    try: dl = dl.new(shuffle=shuffle, drop_last=drop)
    except Exception: dl = copy_loader(dl)
    if hasattr(dl, 'rng'): dl.rng = random.Random(seed)   # fastai's loaders draw their order (and a new `rng`) from it
    inner = dl.__dict__.get('dl')
    if inner is not None and inner is getattr(learn.dls.train, '__dict__', {}).get('dl'):
        # a copy of fastai's `DistributedDL` shares the loader it wraps, whose RNG draws each epoch's order: the copy
        # draws from one of its own, so that the training order is left as it was (`precise` moved it)
        dl.dl = copy_loader(inner)
        if hasattr(dl.dl, 'rng'): dl.dl.rng = random.Random(seed)
    return dl

