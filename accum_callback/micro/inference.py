"""Inference batches under `MicroBatching('auto')` (fit's validation, `validate`, `get_preds`, `predict`, `tta`): when
the model's forward or the loss runs out of memory, that call is re-run in pieces of half the size (then a quarter, ...)
and joined, so that the callbacks, the loss value and every metric see the whole batch."""
from __future__ import annotations
import gc, warnings
from collections.abc import Mapping

import torch

from ..core.distributed import is_fsdp, unwrap
from ..core.losses import loss_items, loss_reduction, model_loss, own_loss_items
from .pieces import (batch_size, cat_outputs, first_line, halved, is_out_of_memory, mapping_like, piece_bounds,
                     slice_batch)
from .state import RowStates, stateful_modules
from ..core.protocols import user_stacklevel

__all__ = ['InferenceCutter']

class InferenceCutter:
    """Runs fastai's `one_batch` on inference batches with the model's forward and the loss cut into pieces after an
    out-of-memory error; `size` (None: not cut) is the largest piece that fitted, kept for later batches. `rows` gives a
    stateful model's per-row state (the training fit's, or one for the call)"""
    def __init__(self): self.size,self.learn,self.rows,self.train_size = None,None,None,None

    def one_batch(self, one_batch, i, b):
        # under DDP the wrapped module: DDP's own forward runs once per batch
        learn,model = self.learn,unwrap(self.learn.model)
        own = model.__dict__.get('forward')
        fwd = own if own is not None else model.forward
        model.forward = lambda *args, **kw: self._cut(fwd, args, kw, self._forward_pieces)
        lf = learn.loss_func
        if lf is not None: learn.loss_func = _CutLoss(lf, self)
        try: return one_batch(i, b)
        finally:
            learn.loss_func = lf
            if own is None: model.__dict__.pop('forward', None)
            else: model.forward = own

    def _cut(self, fn, args, kw, pieces):
        """`fn(*args, **kw)` on the whole batch, or in `pieces(fn, args, kw, n, size)` after an out-of-memory error,
        halving"""
        n = batch_size(args) or 1
        while True:
            size = self.size
            try:
                if size is None or size >= n: return fn(*args, **kw)
                return pieces(fn, args, kw, n, size)
            except BaseException as e:
                if not is_out_of_memory(e): raise
                msg = first_line(e)
                e.__traceback__ = None
            gc.collect()
            if torch.cuda.is_available(): torch.cuda.empty_cache()
            cur = min(size or n, n)
            if cur <= 1:
                raise RuntimeError(f"MicroBatching('auto'): out of memory in inference with a batch of 1 "
                                   f"item ({msg}). The model does not fit this device even for one item") from None
            if is_fsdp(self.learn.model):
                raise RuntimeError(f"MicroBatching('auto'): out of memory in inference under FSDP2 ({msg}); "
                                   "its all-gathers cannot be re-run on one rank: make the validation batch smaller "
                                   "(`dls.valid.bs`)") from None
            self.size = halved(cur)
            warnings.warn(f"GradientAccumulation: out of memory in inference with a batch of {cur} ({msg}); inference "
                          f"batches are now cut into pieces of {self.size} (training keeps micro_bs {self.train_size})",
                          stacklevel=user_stacklevel())

    def _forward_pieces(self, fwd, args, kw, n:int, size:int):
        "The model's outputs of the batch's pieces, joined; a stateful model runs each piece from its own rows"
        rows = self.rows if self.rows else RowStates(stateful_modules(self.learn.model)[0])
        if rows: rows.begin(n)
        try:
            outs,counts = [],[]
            for s,e in piece_bounds(n, size):
                if rows: rows.enter(s, e)
                piece = slice_batch(args, s, e)
                outs.append(fwd(*piece, **kw))
                counts.append(self._own_count(outs[-1], piece, e-s))
                if rows: rows.leave(s, e)
            out = _joined(outs, counts)
        except BaseException:
            if rows: rows.n = None
            raise
        if rows: rows.end()
        return out

    def _own_count(self, out, xb, rows:int):
        """What a piece's own loss (a `ModelOutput`'s 0-d `loss`) averages over, as training counts it; its rows
        otherwise"""
        loss = model_loss(out)
        if loss is None: return None
        c = own_loss_items(_PieceView(out, loss, tuple(xb), self.learn.model))
        return c if c is not None else torch.tensor(float(rows))

    @staticmethod
    def _loss_pieces(lf, args, kw, n:int, size:int):
        """The loss of the whole batch from its pieces' losses `lf(pred[s:e], *yb[s:e])`: a sum for a loss that sums,
        else the mean weighted by the count each piece's mean is over (`loss_items`: class weights, `ignore_index`), the
        piece's items otherwise; per-item losses (reduction 'none') joined"""
        outs,ns = [],[]
        for s,e in piece_bounds(n, size):
            pred,*yb = slice_batch(args, s, e)
            outs.append(lf(pred, *yb, **kw))
            c = loss_items(lf, yb)
            ns.append(c if c is not None else torch.tensor(float(e-s)))
        if any(o.ndim for o in outs): return torch.cat(outs)
        loss = torch.stack(outs)
        if loss_reduction(lf) == 'sum': return loss.sum()
        w = torch.stack([torch.as_tensor(c, dtype=torch.float32) for c in ns]).to(loss.device)
        # a piece of no item counts nothing
        return (torch.where(w > 0, loss.float()*w, 0.).sum()/w.sum()).to(loss.dtype)

class _PieceView:
    "What `own_loss_items` reads of a piece: its output, its loss, its inputs, the model"
    def __init__(self, pred, loss, xb, model): self.pred,self.loss_grad,self.xb,self.model = pred,loss,xb,model

def _joined(outs:list, counts:list):
    """The pieces' outputs joined along the batch; a model's own 0-d loss (a `ModelOutput`'s `loss`) joined as the mean
    of the pieces' losses weighted by the counts each averages over (`counts`: tokens with labels, else rows), and
    what cannot be joined (a key-value cache object) left out"""
    o = outs[0]
    if model_loss(o) is None or not isinstance(o, Mapping): return cat_outputs(outs)
    keep = [k for k,v in o.items() if k != 'loss'
            and (v is None or isinstance(v, (torch.Tensor, tuple, list, Mapping)))]
    # (a key-value cache of pieces is no batch's: left out)
    rest = cat_outputs([{k: x[k] for k in keep} for x in outs])
    loss = torch.stack([x['loss'] for x in outs])
    w = torch.stack([torch.as_tensor(c, dtype=torch.float64) for c in counts]).to(loss.device)
    # a piece of no item counts nothing
    joined = (torch.where(w > 0, loss.double()*w, 0.).sum()/w.sum()).to(loss.dtype)
    return mapping_like(o, {'loss': joined, **rest})

class _CutLoss:
    "The Learner's loss in an inference batch under micro_bs='auto': cut into pieces when it runs out of memory"
    def __init__(self, lf, cutter:InferenceCutter): self.lf,self.cutter = lf,cutter
    def __call__(self, *args, **kw):
        # a model's own loss is in its output, already joined by its counts: reading it needs no piece
        if args and model_loss(args[0]) is not None: return self.lf(*args, **kw)
        return self.cutter._cut(self.lf, args, kw, self.cutter._loss_pieces)
    def __getattr__(self, k): return getattr(self.__dict__['lf'], k)   # `activation`, `decodes`, ... as the loss's own
