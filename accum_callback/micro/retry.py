"""Undoing a micro-batch that ran out of memory (or that another DDP rank cancelled): what it can change before its
backward ends is kept before it begins (`Snapshot.take`), and put back (`Snapshot.undo`), so that the same samples run
again smaller as if the attempt had not happened."""
from __future__ import annotations
import gc, random

import torch
from fastai.callback.fp16 import MixedPrecision

from ..compat.torch import BatchNormBase, autocast_enabled, foreach
from ..core.protocols import Listeners

__all__ = ['Snapshot', 'PeerOutOfMemory']

class PeerOutOfMemory(Exception):
    "Another DDP rank ran out of memory in this micro-batch: this rank undoes it too, and every rank retries smaller"

class Snapshot:
    """The RNG states (CPU, CUDA, Python's: dropout replays), every BatchNorm's running statistics and
    `num_batches_tracked`, Batch Renorm's step counters, autocast, the window's record (through `window_state`/
    `restore_window`, the accumulation's own) and, with a window open, its accumulated gradient. The tensors to copy are
    gathered once per fit; taking a snapshot allocates nothing after the first and makes no host synchronisation"""
    def __init__(self, learn, window_state, restore_window):
        self.learn,self.window_state,self.restore_window,self.listeners = learn,window_state,restore_window,Listeners()
        self._state,self.snap = None,None

    def _tensors(self)->dict:
        if self._state is None:
            learn,model = self.learn,self.learn.model
            bufs = [t for m in model.modules() if isinstance(m, BatchNormBase)
                    for t in (m.running_mean, m.running_var, m.num_batches_tracked) if t is not None]
            renorms = [m for m in model.modules() if hasattr(m, 'renorm_steps')]
            params = [p for p,*_ in learn.opt.all_params()] if getattr(learn, 'opt', None) else list(model.parameters())
            self._state = dict(bufs=bufs, buf_copy=[t.clone() for t in bufs], renorms=renorms, params=params,
                               grad_copy=None)
        return self._state

    def take(self):
        "Keep what the micro-batch about to run can change"
        st = self._tensors()
        window,open_ = self.window_state()
        dev = next(iter(st['params']), torch.empty(0)).device
        self.snap = dict(rng=torch.get_rng_state(), py=random.getstate(), dev=dev,
                         cuda=torch.cuda.get_rng_state(dev) if dev.type == 'cuda' else None,
                         window=window, renorm=[m.renorm_steps for m in st['renorms']],
                         autocast=autocast_enabled(dev.type) if dev.type in ('cuda', 'cpu') else False, grads=open_)
        if st['bufs']: foreach('copy_')(st['buf_copy'], st['bufs'])
        if open_:   # an open window: its accumulated gradient (else the gradients are zero)
            ps = [p for p in st['params'] if p.grad is not None]
            gc_ = st['grad_copy']
            if gc_ is None or len(gc_[0]) != len(ps) or any(a is not b for a,b in zip(gc_[0], ps)):
                st['grad_copy'] = (ps, [torch.empty_like(p.grad) for p in ps])
            if ps: foreach('copy_')(st['grad_copy'][1], [p.grad for p in ps])

    def undo(self, drop:bool=True):
        """Put back everything the micro-batch in progress touched; `drop` its tensors (not kept for a cancel's
        `after_batch`)"""
        learn,snap,st = self.learn,self.snap,self._state
        if drop: learn.pred = learn.loss = learn.loss_grad = None
        dev = snap['dev']
        if dev.type in ('cuda', 'cpu') and autocast_enabled(dev.type) and not snap['autocast']:
            for cb in learn.cbs:   # MixedPrecision enters autocast in `before_batch` and leaves it in `after_loss`
                if isinstance(cb, MixedPrecision) and getattr(cb, 'autocast', None) is not None:
                    cb.autocast.__exit__(None, None, None)
        self.listeners()
        gc.collect()
        if dev.type == 'cuda': torch.cuda.empty_cache()
        torch.set_rng_state(snap['rng']); random.setstate(snap['py'])
        if snap['cuda'] is not None: torch.cuda.set_rng_state(snap['cuda'], dev)
        if st['bufs']: foreach('copy_')(st['bufs'], st['buf_copy'])
        for m,v in zip(st['renorms'], snap['renorm']): m.renorm_steps = v
        if snap['grads'] and st['grad_copy'] is not None:
            ps,copy = st['grad_copy']
            foreach('copy_')([p.grad for p in ps], copy)
            kept = set(map(id, ps))
            for p in st['params']:
                if p.grad is not None and id(p) not in kept: p.grad.zero_()
        else:
            for p in st['params']:
                if p.grad is not None: p.grad.zero_()
        self.restore_window(snap['window'])
