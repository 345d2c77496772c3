"""The training loader, cut: each loader batch into near-equal micro-batches (`piece_bounds`'s rule), read by fastai's
loop in place of `learn.dl`; and `Piece`, what `GradientAccumulation` reads of the piece being run."""
from __future__ import annotations
from dataclasses import dataclass

from fastai.callback.core import Callback
from fastai.torch_core import find_bs, to_device

from ..core.batches import prepare_batch
from ..core.distributed import is_distributed
# (re-exported: their home before 0.3)
from ..core.loaders import FeedLoader, ReadAhead, batch_sizes, model_device, own_loader, with_last
from .pieces import n_pieces, next_piece, piece_bounds, slice_batch

__all__ = ['Piece', 'MicroBatches', 'CutLoader', 'ReadAhead', 'with_last', 'batch_sizes', 'model_device', 'own_loader',
           'loader_pieces']


def loader_pieces(learn, size:int|None, shuffle:bool=False, seed:int=0, epochs:int=1, drop_last:bool|None=None):
    """Yield `(micro-batch, (rows start, rows end, loader batch size))` of `own_loader`'s batches, each cut into the
    pieces `MicroBatching(size)` cuts it into (`piece_bounds`; None: uncut), over `epochs` passes; each piece as the
    training step sees it (`prepare_batch`: the device, fastai's casting, the callbacks' `before_batch`), inputs then
    targets"""
    dl = own_loader(learn, shuffle, seed, drop_last)
    for _ in range(epochs):
        for b in dl:
            b = to_device(b, model_device(learn.model))
            n = find_bs(b)
            for s,e in piece_bounds(n, size):
                xb,yb = prepare_batch(learn, b if (s, e) == (0, n) else slice_batch(b, s, e))
                yield xb + yb,(s, e, n)

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

class MicroBatches(FeedLoader):
    """The training loader with each of its batches cut into `ceil(n / size)` near-equal micro-batches (none larger than
    the size in force, none needlessly small: a BatchNorm layer cannot train on one item). Everything else is the real
    loader's (`bs`, `device`, `dataset`, ...). After an out-of-memory error `retry` makes it cut the same samples again,
    at the size in force then. `mb` is the `MicroBatching` callback: its `size`, `rows`,
    `batch_started`/`batch_done`."""
    def __init__(self, dl, mb):
        super().__init__(dl); self.mb = mb
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
        for bi,(b,last) in enumerate(with_last(self.feed(self.dl)),
                                     start=self.feed.skip - (self.feed.first is not None)):
            # (`batch`: the loader batch being cut, whose pieces 'window' measures at its start)
            n,self.batch = find_bs(b),b
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
