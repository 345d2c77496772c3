"""The training loader, cut: each loader batch into near-equal micro-batches (`piece_bounds`'s rule), read by fastai's loop
in place of `learn.dl`; and `Piece`, what `GradientAccumulation` reads of the piece being run."""
from __future__ import annotations
import math, random
from dataclasses import dataclass

import torch
from fastai.callback.core import Callback
from fastai.torch_core import find_bs, to_device

from ..distributed import is_distributed
from ..fastai_compat import copy_loader, torch_loader
from .pieces import n_pieces, next_piece, piece_bounds, slice_batch

__all__ = ['Piece', 'MicroBatches', 'CutLoader', 'ReadAhead', 'with_last', 'batch_sizes', 'model_device', 'own_loader',
           'loader_pieces']

def batch_sizes(dl)->list:
    """The loader's batch sizes in an epoch, where it says (fastai's `n`, `bs`, `drop_last`), else `bs` each. fastai's
    `DistributedDL` counts what each rank really reads (its `len` is the whole loader's over the world, often one more)"""
    inner,world = getattr(dl, 'dl', None),getattr(dl, 'world_size', None)
    if type(dl).__name__ == 'DistributedDL' and getattr(inner, 'n', None) is not None and world and getattr(dl, 'bs', None):
        n,bs = math.ceil(inner.n/world),dl.bs   # every rank reads the padded share of the set
        nb = n//bs if dl.drop_last else math.ceil(n/bs)
    else: n,bs,nb = getattr(dl, 'n', None),getattr(dl, 'bs', None),len(dl)
    if n is None or not bs: return [bs or 1]*nb
    return [min(bs, n - i*bs) for i in range(nb)]

class Feed:
    """The training loader's batches as fetched, for a checkpoint taken between micro-batches (`accum_callback.checkpoint`):
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
    `DistributedDL`, a rank's share) draw them, less the first `k` batches' worth (once: the next pass is whole); `then()`
    once they are drawn. Returns what to undo once the pass has started"""
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

def can_skip(dl)->bool: "Can `dl` leave batches out of a pass unloaded (`Feed.skip`)?"; return hasattr(dl, 'get_idxs') and bool(getattr(dl, 'bs', None))

def with_last(it):
    "Yield `(item, is_last)` of an iterable: its end is where its iterator ends, whatever its `len` says (one item read ahead)"
    it = iter(it)
    try: cur = next(it)
    except StopIteration: return
    for nxt in it:
        yield cur,False
        cur = nxt
    yield cur,True

class ReadAhead:
    """The training loader read one batch ahead, so that `last` tells whether the batch being run is the epoch's last
    (fastai's loop knows only `len`, which a loader such as `DistributedDL`, a custom sampler or an iterable dataset can
    overstate). Everything else is the real loader's. It holds one more batch than fastai does"""
    def __init__(self, dl): self.dl,self.last,self.feed = dl,False,Feed()
    def __getattr__(self, k):
        if k in ('dl', 'feed'): raise AttributeError(k)
        return getattr(self.dl, k)
    def __len__(self)->int: return len(self.dl)
    def __iter__(self):
        self.last = False
        for b,self.last in with_last(self.feed(self.dl)): yield b

def model_device(model)->torch.device: "Where `model`'s parameters are (the CPU for a model without any)"; return next(iter(model.parameters()), torch.empty(0)).device

def own_loader(learn, shuffle:bool=False, seed:int=0, drop_last:bool|None=None):
    """A copy of the training loader in an order of its own, for the check, the noise scale and the recomputed BatchNorm
    statistics: the loader's order, or shuffled from `seed` (dropping an incomplete last batch as training does, unless
    `drop_last`); the Learner's loader and its RNG are not touched. A loader of ready-made batches (`bs=None`) has no
    incomplete batch to drop; one that cannot copy itself is read in its own order, from a copy"""
    dl = learn.dls.train
    if not hasattr(dl, 'new'): return dl
    drop = (shuffle if drop_last is None else drop_last) and bool(getattr(dl, 'bs', None))   # (fastai refuses it at bs=None)
    try: dl = dl.new(shuffle=shuffle, drop_last=drop)
    except Exception: dl = copy_loader(dl)
    if hasattr(dl, 'rng'): dl.rng = random.Random(seed)   # fastai's loaders draw their order (and a new `rng`) from it
    inner = dl.__dict__.get('dl')
    if inner is not None and inner is getattr(learn.dls.train, '__dict__', {}).get('dl'):
        # a copy of fastai's `DistributedDL` shares the loader it wraps, whose RNG draws each epoch's order: the copy
        # draws from one of its own, so that the training order is left as it was (issue 63: `precise` moved it)
        dl.dl = copy_loader(inner)
        if hasattr(dl.dl, 'rng'): dl.dl.rng = random.Random(seed)
    return dl

def loader_pieces(learn, size:int|None, shuffle:bool=False, seed:int=0, epochs:int=1, drop_last:bool|None=None):
    """Yield `(micro-batch, (rows start, rows end, loader batch size))` of `own_loader`'s batches on the model's device,
    each cut into the pieces `micro_bs=size` cuts it into (`piece_bounds`; None: uncut), over `epochs` passes"""
    dl = own_loader(learn, shuffle, seed, drop_last)
    for _ in range(epochs):
        for b in dl:
            b = to_device(b, model_device(learn.model))
            n = find_bs(b)
            for s,e in (piece_bounds(n, size) if size else [(0, n)]):
                yield (b if (s, e) == (0, n) else slice_batch(b, s, e)),(s, e, n)

@dataclass
class Piece:
    """The micro-batch being run, as `GradientAccumulation` sees it: `serial` (which loader batch, counting from 1 in a
    fit), `batch_n` (that batch's items), `start`/`end` (the piece's rows), `last_piece` (the batch's last piece, which
    acts for the window), `last_batch` (the epoch's last loader batch)"""
    serial: int = 0
    batch_n: int = 0
    start: int = 0
    end: int = 0
    last_piece: bool = False
    last_batch: bool = False

class MicroBatches:
    """The training loader with each of its batches cut into `ceil(n / size)` near-equal micro-batches (none larger than
    the size in force, none needlessly small: a BatchNorm layer cannot train on one item). Everything else is the real
    loader's (`bs`, `device`, `dataset`, ...). After an out-of-memory error `retry` makes it cut the same samples again,
    at the size in force then. `mb` is the `MicroBatching` callback: its `size`, `rows`, `batch_started`/`batch_done`."""
    def __init__(self, dl, mb):
        self.dl,self.mb,self.feed = dl,mb,Feed()
        self.piece,self.batch_index,self.retry,self._nom = Piece(),-1,False,None
    def __getattr__(self, k):
        if k in ('dl', 'mb', 'feed'): raise AttributeError(k)
        return getattr(self.dl, k)
    def __len__(self)->int:
        "Micro-batches this epoch at the size in force (fastai's `n_iter` and progress bar read it)"
        m = self.mb.size
        return sum(n_pieces(b, m) for b in batch_sizes(self.dl)) if m else len(self.dl)
    def pieces_left(self)->int:
        "Micro-batches still to run this epoch at the size in force, the one being (re)run included"
        m,sizes,p = self.mb.size,batch_sizes(self.dl),self.piece
        rest = sum(n_pieces(b, m) for b in sizes[self.batch_index+1:]) if m else len(sizes)-self.batch_index-1
        if self.batch_index < 0: return rest
        k,s,nom = 0,p.start,self._nom
        while s < p.batch_n: s,nom = next_piece(s, p.batch_n, m, nom); k += 1
        return rest + k
    def __iter__(self):
        nb,bs,mb = len(self.dl),self.dl.bs,self.mb
        for bi,(b,last) in enumerate(with_last(self.feed(self.dl)), start=self.feed.skip - (self.feed.first is not None)):
            n = find_bs(b)
            # under DDP/FSDP2 every rank cuts as many pieces (fastai's Recorder gathers each; FSDP2's collectives match)
            self._nom = bs if (is_distributed(mb.learn.model) and bs) else None
            p = self.piece = Piece(serial=mb.batch_started(n), batch_n=n, last_batch=last)
            self.batch_index = bi
            if mb.rows: mb.rows.begin(n)   # a stateful model: the state this batch starts from, per row
            while p.start < n:
                p.end,nom = next_piece(p.start, n, mb.size, self._nom)
                p.last_piece = p.end == n
                yield slice_batch(b, p.start, p.end) if (p.start, p.end) != (0, n) else b
                if self.retry: self.retry = False   # the same samples again, at the size in force now
                else: p.start,self._nom = p.end,nom
            if mb.rows: mb.rows.end()
            mb.batch_done(n)
        self.batch_index = nb

    def progress(self)->float|None:
        "How far through the epoch's loader batches the micro-batch just run is"
        p = self.piece
        return (self.batch_index + p.end/p.batch_n)/len(batch_sizes(self.dl)) if p.batch_n else None

class CutLoader(Callback):
    """Replaces the training loader (cut into micro-batches by `MicroBatching`, read ahead by `GradientAccumulation`)
    once every callback that replaces it has (fastai's `DistributedTrainer`, order 11, wraps `learn.dl` in
    `DistributedDL` in its `before_train`: cut before it, the pieces were wrapped again and never cut), and before
    anything reads its length (the progress bar, order 60). Added by its owner (`mb`) for the length of a fit"""
    order,run_valid = 12,False
    def __init__(self, mb): self.mb = mb
    def before_train(self): self.mb.start_train()
