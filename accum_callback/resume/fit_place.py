"""The place in a fit, a piece of its state (`Checkpoint` is the manager that says when, where and which file): the
epoch and the loader batches done in it, the global RNGs and the training loader's (its order of the epoch, drawn at the
epoch's start), the batch read ahead, the state a model carries from batch to batch, and, for a resumed fit, the epochs
it skips. `state(learn, where)` takes it; `load(learn, st)` puts back what a fit start needs, `continue_epoch(learn,
st)` the rest where the resumed epoch's training starts; `skip_epochs` / `skip_epoch` / `after_epoch` sit done epochs
out the way fastai's `SkipToEpoch` does, each callback seeing its events and the Recorder logging the rows kept for
them."""
from __future__ import annotations

from fastai.callback.core import CancelEpochException
from fastai.torch_core import find_device, to_device
from fastcore.foundation import L

from ..compat.torch import rng_states, set_rng_states
from ..core.distributed import process_count, unwrap
from ..core.loaders import feed_of, inner_loader
from .fit_state import (carried_state, load_carried_state, loader_orders, loader_rngs, restore_recorder,
                        set_loader_orders,
                        set_loader_rngs, settle_loaders)

__all__ = ['FitPlace', 'inner_loader']


class FitPlace:
    """Where a fit is: `k` loader batches done in this epoch; the RNG states and the loader's as the epoch started (its
    order is drawn from them); `iter_offset`, what a resumed epoch's `learn.iter` counts from; `skip_to`, the first
    epoch a resumed fit runs (those before it are done)"""
    def __init__(self):
        self.k,self.iter_offset,self.skip_to,self.pending,self.quiet,self.rows = 0,0,None,None,[],([], [])
        self.start_rngs = self.start_loader_rngs = self.start_orders = None

    def start_epoch(self, learn):
        "The training loader's epoch starts (`before_train`, the read-ahead in place): its order is drawn from these"
        inner = inner_loader(learn.dl)
        self.start_loader_rngs,self.start_rngs,self.start_orders = loader_rngs(inner),rng_states(),loader_orders(inner)
        self.k,self.iter_offset = 0,0
        if self.pending is not None: self.continue_epoch(learn, self.pending); self.pending = None

    def state(self, learn, where:str)->dict:
        """The place as a checkpoint holds it: 'mid' an epoch (its start's RNGs and order, the batch read ahead, what
        the model carries), or at an epoch's or the fit's end"""
        mid,model,train = where == 'mid',unwrap(learn.model),inner_loader(learn.dls.train)
        feed = feed_of(learn.dl) if mid else None
        ahead = feed.ahead if feed is not None else None
        return dict(where=where, world=process_count(), epoch=learn.epoch, k=self.k,
                    iter_done=getattr(learn, 'iter', -1) + 1 if mid else 0, rngs=rng_states(),
                    epoch_rngs=self.start_rngs if mid else None,
                    loader_orders=self.start_orders if mid else loader_orders(train),
                    loader_rngs=self.start_loader_rngs if mid else loader_rngs(train),
                    carried=carried_state(model) if mid else None,
                    ahead=to_device(ahead, 'cpu') if ahead is not None else None,
                    ahead_device=find_device(ahead) if ahead is not None else None,
                    pct_train=getattr(learn, 'pct_train', 0.), train_iter=getattr(learn, 'train_iter', 0))

    def load(self, learn, st:dict):
        """At the fit's start: the place's numbers, and at an epoch's or a fit's end the RNGs and the loader's as they
        were (a mid-epoch one goes on in `continue_epoch`, where its epoch's training starts)"""
        settle_loaders(learn.dls)   # (before the RNGs are put back)
        learn.epoch,learn.pct_train,learn.train_iter = st['epoch'],st['pct_train'],st['train_iter']
        if st['where'] != 'mid':
            set_rng_states(st['rngs'])
            set_loader_rngs(inner_loader(learn.dls.train), st['loader_rngs'])
            set_loader_orders(inner_loader(learn.dls.train), st.get('loader_orders'))
        else: self.pending = st

    def continue_epoch(self, learn, st:dict):
        """The epoch the checkpoint was taken in starts: its order, the batches done skipped unloaded, the RNGs as they
        were"""
        inner = inner_loader(learn.dl)
        set_loader_rngs(inner, st['loader_rngs'])
        set_loader_orders(inner, st.get('loader_orders'))
        self.start_loader_rngs,self.start_orders = st['loader_rngs'],st.get('loader_orders')
        feed = feed_of(learn.dl)
        # the batches done, and the one read ahead (saved: made again, its random transforms would draw again), skipped
        feed.skip = st['k'] + (st['ahead'] is not None)
        if st['ahead'] is not None: feed.first = to_device(st['ahead'], st['ahead_device'])
        if st.get('epoch_rngs') is not None:   # the loader draws the epoch's order as at its start, then the batches
            set_rng_states(st['epoch_rngs'])   # after the one read ahead draw from where the interrupted run was
            self.start_rngs = st['epoch_rngs']
            feed.then = lambda: set_rng_states(st['rngs'])
        else: set_rng_states(st['rngs'])
        if st.get('carried'): load_carried_state(unwrap(learn.model), st['carried'])   # (after ModelResetter's reset)
        self.k,self.iter_offset = st['k'],st.get('iter_done', 0)
        # (fastai's `before_train` set these for the epoch's start after the load: its place in the epoch again)
        learn.pct_train,learn.train_iter = st['pct_train'],st['train_iter']
        restore_recorder(learn.recorder, st['recorder'])

    # -- the epochs a resumed fit has done ------------------------------------------------------------------------
    def skip_epochs(self, learn, first:int, quiet:list):
        """Epochs before `first` are done: each is cancelled in `before_epoch` (fastai's own `SkipToEpoch` mechanism),
        so every callback sees its events (the progress bar, `ShowGraphCallback`, `CSVLogger`), and the Recorder logs
        the row the checkpoint kept for it. `quiet`: the callbacks whose state was restored sit the skipped epochs out
        (fastai's `Callback.run`): a tracker seeing a done epoch's row again counts it twice (ReduceLROnPlateau cut the
        learning rate again, EarlyStopping stopped)"""
        self.skip_to,self.quiet = first,(quiet if first > 0 else [])
        for cb in self.quiet: cb.run = False
        rec = learn.recorder
        self.rows = list(getattr(rec, 'values', [])),list(getattr(rec, 'iters', []))
        rec.values,rec.iters = [],[]   # (appended again, epoch by epoch, as the skipped epochs end)

    def skipped(self, epoch:int)->bool:
        "Is `epoch` one a resumed fit has done?"; return self.skip_to is not None and epoch < self.skip_to
    def skipped_all(self, n_epoch:int)->bool: return self.skip_to is not None and self.skip_to >= n_epoch

    def skip_epoch(self, learn):
        "`before_epoch`: a done epoch is cancelled, the Recorder's row for it as the checkpoint kept it"
        if not self.skipped(learn.epoch): return
        values,_ = self.rows
        if learn.epoch < len(values): learn.recorder.log = L([learn.epoch]) + L(values[learn.epoch])
        raise CancelEpochException()

    def after_skipped_epoch(self, learn):
        """`after_epoch` of a done epoch: the Recorder's count of its iterations as kept; the quiet callbacks run again
        after the last"""
        rec,(_,iters) = learn.recorder,self.rows
        if learn.epoch < len(iters) and rec.iters: rec.iters[-1] = iters[learn.epoch]
        if learn.epoch == self.skip_to - 1:
            for cb in self.quiet: cb.run = True
