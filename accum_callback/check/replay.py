"""The replay engine: a copy of the model run as the Learner's training step runs it, on micro-batches taken from its
training loader, without touching the Learner (weights, buffers, optimizer, RNG states, gradients, modes, callbacks).
`check_accumulation` runs its experiments on it and `learn.noise_scale()` its windows; both accumulate by the same
`Window` rule as training."""
from __future__ import annotations
import contextlib, math
from typing import NamedTuple

import torch
from fastai.callback.fp16 import MixedPrecision
from fastai.torch_core import find_bs

from ..compat.torch import BatchNormBase
from ..core.distributed import unwrap
from ..core.batches import prepare_batch, split_batch, step_kept
from ..core.losses import loss_reduction, micro_items
from ..micro import RowStates, cat_outputs, copy_module, stateful_modules
from ..core.loaders import model_device, own_loader
from ..micro.loader import loader_pieces
from ..batchnorm.norm_layers import is_batchnorm, set_norm_mode
from ..batchnorm.precise import rng_states, set_rng_states
from ..window.state import Window

__all__ = ['Replay', 'Grads', 'micro_batches', 'training_model', 'flat_out']

class Grads(NamedTuple):
    "A flat gradient over the parameters that train (`names`, `sizes` in elements), and whether all of it is finite"
    flat: torch.Tensor
    finite: bool
    names: list
    sizes: list

def training_model(learn, bna=None):
    """The model as training runs it, to replay on: unwrapped from DDP (each rank its own samples, no collectives), and
    converted as `BatchNormAccumulation` ('groupnorm', 'renorm') will convert it, on a copy"""
    model = unwrap(learn.model)
    if bna is not None and bna.converts and any(is_batchnorm(m) for m in model.modules()):
        model = bna.convert(copy_module(model))
    return model

# -- taking the micro-batches
# ----------------------------------------------------------------------------------------------
def micro_batches(learn, n_step:int, size, shuffle:bool=False, seed:int=0)->tuple[list,list,object]:
    """The first `n_step` micro-batches of the training loader (unshuffled), each a loader batch or a piece of one,
    where each comes from: `(rows start, rows end, loader batch size)`, and that loader"""
    out,where = [],[]
    for b,w in loader_pieces(learn, size):
        out.append(b); where.append(w)
        if len(out) == n_step: return out,where,own_loader(learn)
    raise ValueError(f"`n_step`: the training loader gives only {len(out)} micro-batch(es), fewer than "
                     f"n_step={n_step}; pass a smaller n_step")


def replayed(learn)->list:
    """The Learner's callbacks that shape what the loss sees in a training step (`after_pred`: fastai's RNNCallback
    keeps the output the loss takes, a wrapper picks a model's logits; `after_loss`: RNNRegularizer's AR/TAR terms), in
    their order. Not ours, not mixed precision (the check runs autocast itself), not fastai's own
    GradientAccumulation."""
    from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
    return [cb for cb in learn.cbs.sorted('order')
            if not isinstance(cb, (MixedPrecision, FastaiGradientAccumulation))
            and not type(cb).__module__.startswith('accum_callback')
            and any(callable(getattr(type(cb), e, None)) for e in ('after_pred', 'after_loss'))]

def sandbox(learn, cbs:list):
    """Whatever replaying `cbs`' events sets on the Learner (its step's attributes) and on the callbacks is put back
    after"""
    return step_kept(learn, cbs)

def replay_event(learn, cbs:list, event:str):
    for cb in cbs:
        try: cb(event)
        except Exception as e:
            what = (f"raised {type(e).__name__}: the check cannot follow a callback that cancels a micro-batch; run it "
                    f"with that callback removed (`with learn.removed_cbs(cb): learn.check_accumulation()`)"
                    if type(e).__name__.startswith('Cancel') else f"failed: {e}")
            raise RuntimeError(f"check_accumulation: replaying `{type(cb).__name__}.{event}` (what training runs "
                               f"between the model and the backward) on the check's copy {what}") from e

def split_xy(learn, b):
    "`(xb, yb)` of a prepared batch (`loader_pieces`'s: inputs, then targets)"; return split_batch(learn, b)

class _View:
    "What `n_items(learn)` reads: this micro-batch's `xb`, `yb`, `pred`, `loss`; anything else from the Learner"
    def __init__(self, learn, **kw): self.__dict__.update(kw); self._learn = learn
    def __getattr__(self, k): return getattr(self.__dict__['_learn'], k)

class Replay:
    """A copy of the model run as the Learner's training step runs it (its callbacks' `after_pred`/`after_loss`
    replayed, autocast as `MixedPrecision`, BatchNorm's and dropout's modes switched), on micro-batches addressed by
    index into `batches` (`where[i]`: where micro-batch i comes from, `(rows start, rows end, loader batch size)`), each
    pass from the model as it is now (`fresh`: buffers, per-row state, the RNG). `grads` accumulates a window by the
    window's own rule (`Window`), or runs one batch of it. Used by `check_accumulation` (which adds its experiments) and
    `learn.noise_scale()`."""
    def __init__(self, learn, batches, model, ga, bna, where:list, dl=None):
        self.learn,self.ga,self.bna,self.dl = learn,ga,bna,dl
        self.model0,self.replay = model,replayed(learn)
        self.stateful = any(map(any, stateful_modules(model)))   # splittable or not: its state is copied per pass
        self.load(batches, where)
        self.model = copy_module(model)
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        # Batch Renorm's ramp
        self.steps = [(m, m.renorm_steps) for m in self.model.modules() if hasattr(m, 'renorm_steps')]
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        amp = getattr(mp, 'amp_mode', None) if mp is not None else None
        self.autocast = {'fp16': torch.float16,
                         'bf16': torch.bfloat16}.get(str(getattr(amp, 'value', amp)).lower().replace('amptype.', ''))
        # fastai's MixedPrecision autocasts on CUDA only (`autocast('cuda')`): a model on the CPU trains in its own
        # dtype
        if model_device(model).type != 'cuda': self.autocast = None
        p = next(iter(model.parameters()), None)
        self.dtype = self.autocast or (p.dtype if p is not None else torch.float32)
        # the dtype the loss came out in (fastai's flattened losses give float32 for float64 input)
        self.loss_dtype = None
        self.recomputed_bn = False   # a BatchNorm forward ran during a backward (activation checkpointing)
        self.rng = rng_states()
        # replay the callbacks' `after_loss` (RNNRegularizer's AR/TAR); off for the regularizer experiment
        self.loss_terms = True

    def load(self, batches:list, where:list):
        "The micro-batches to run (a window) and where each comes from"
        self.batches = [split_xy(self.learn, b) for b in batches]
        self.where = list(where)
        self.n_window = len(self.batches)   # the window's micro-batches (the check adds pieces of its own after them)
        # pieces of loader batches on a model with per-row state: each starts from its own rows, as under micro_bs
        self.cut_rows = self.stateful and any((s, e) != (0, n) for s,e,n in self.where)

    @property
    def window(self)->list: return list(range(self.n_window))
    @property
    def adds_loss_terms(self)->bool:
        "Does a replayed callback add to the loss after it is computed (RNNRegularizer's AR/TAR)?"
        return any(callable(getattr(type(cb), 'after_loss', None)) for cb in self.replay)

    def fresh(self):
        "The copy as the Learner's model is now (buffers, and any state a stateful model carries), the RNG as it was"
        if self.stateful: self.model = copy_module(self.model0)
        else:
            with torch.no_grad():
                for b,v in self.buffers: b.copy_(v)
            for m,k in self.steps: m.renorm_steps = k
        set_rng_states(self.rng)
        return self.model

    def modes(self, m, bn:bool, drop:bool):
        """Training mode as the Learner trains (`bn`, `drop` True), with BatchNorm's batch statistics off (`bn` False:
        its running statistics, as in eval) or every other train-mode behaviour off (`drop` False: dropout,
        drop-path...)"""
        m.train(drop)
        frozen = self.bna is not None and self.bna.mode == 'freeze'
        for mod in m.modules():
            # BatchNorm, SyncBatchNorm, Batch Renorm: their own mode only (a timm norm-act layer's drop follows `drop`)
            if isinstance(mod, BatchNormBase): set_norm_mode(mod, bn and not frozen)

    def _ctx(self, m):
        dev = model_device(m).type
        return (torch.autocast(dev, dtype=self.autocast) if self.autocast is not None
                else torch.autocast(dev, enabled=False))

    def forward(self, m, xb, yb):
        """(prediction, loss) as the Learner's training step computes them: the model's output through the callbacks'
        `after_pred`, the loss through their `after_loss` (see `_replayed`)"""
        lf = self.learn.loss_func
        with self._ctx(m):
            raw = m(*xb)
            if not self.replay: return raw,lf(raw, *yb)
        L = self.learn
        with sandbox(L, self.replay):
            pred = self._pred(raw, xb, yb)
            with self._ctx(m): L.loss_grad = lf(pred, *yb)
            L.loss = L.loss_grad.clone()
            if self.loss_terms: replay_event(L, self.replay, 'after_loss')
            return pred,L.loss_grad

    def _pred(self, raw, xb, yb):
        "The model's output `raw` through the callbacks' `after_pred`, what the loss sees (inside `sandbox`)"
        L = self.learn
        L.xb,L.yb,L.pred,L.training = xb,yb,raw,True
        replay_event(L, self.replay, 'after_pred')
        return L.pred

    def _seen(self, raw, xb, yb):
        "What the loss sees of the model's output `raw`, the Learner put back after"
        if not self.replay: return raw
        with sandbox(self.learn, self.replay): return self._pred(raw, xb, yb)

    def joined(self, idxs)->tuple:
        """`(xb, yb)` of one batch of the micro-batches `idxs`: joined along the batch dimension, or, for micro-batches
        padded to other lengths (text), the loader's own batch of those samples"""
        try: return tuple(cat_outputs([self.batches[i][k] for i in idxs]) for k in (0, 1))
        except RuntimeError: return self._collated(idxs)

    def _collated(self, idxs):
        "The first loader batch of a loader of the same samples with a batch of all the micro-batches `idxs`"
        covered = list(idxs) == list(range(len(idxs))) and all(i < self.n_window for i in idxs) and \
                  self.where[idxs[-1]][1] == self.where[idxs[-1]][2]   # the first whole loader batches
        if not covered or self.dl is None or not hasattr(self.dl, 'new'):
            raise ValueError("check_accumulation: the micro-batches have different shapes (padded to other lengths?) "
                             "and are not whole loader batches, so one batch of them cannot be formed: pass an "
                             "`n_step` of whole loader batches")
        n = sum(e-s for s,e,_ in (self.where[i] for i in idxs))
        b = next(iter(self.dl.new(bs=n, shuffle=False, drop_last=False)))   # (its order: the loader's own, unshuffled)
        return prepare_batch(self.learn, b)

    def pieces(self, m, idxs):
        "Yield the micro-batches `idxs` as `(xb, yb)`; a model with per-row state starts each piece from its own rows"
        rows = RowStates(stateful_modules(m)[0] if (self.cut_rows or self.stateful) else [])
        for i in idxs:
            s,e,n = self.where[i]
            cut = (s, e) != (0, n)
            if rows and cut:
                if s == 0 or rows.n is None: rows.begin(n)
                rows.enter(s, e)
            yield self.batches[i]
            if rows and cut:
                rows.leave(s, e)
                if e == n: rows.end()

    def count(self, xb, yb, pred, loss)->float:
        "Items the micro-batch's mean loss averages over (as the Learner's `GradientAccumulation` counts them), a float"
        view = _View(self.learn, xb=xb, yb=yb, pred=pred, loss=loss, loss_grad=loss)
        return float(micro_items(view, getattr(self.ga, 'n_items', None), find_bs(yb if len(yb) else xb)))

    def grads(self, accumulate:bool, bn=True, drop=True)->Grads:
        """The flat gradient the Learner's step would apply to the window (`accumulate`: micro-batch by micro-batch, by
        the window's rule), or that of one batch of it"""
        m = self.fresh(); self.modes(m, bn, drop)
        for p in m.parameters(): p.grad = None
        lf,finite = self.learn.loss_func,True
        if accumulate:
            w,ws = Window(),self._window_stats(m)
            for xb,yb in self.pieces(m, self.window):
                pred,loss = self.forward(m, xb, yb)
                self.loss_dtype = loss.dtype
                n = self.count(xb, yb, pred, loss)
                if not w.n_micro: w.begin(n, loss_reduction(lf) == 'sum')
                finite = finite and bool(torch.isfinite(loss).all())
                with self._watch_recompute(m): (loss*w.loss_weight(n)).backward()
                w.add(n, find_bs(yb if len(yb) else xb), loss.detach())
            if ws is not None: ws.remove()
            scale = w.step_scale(w.items)
        else:
            xb,yb = self.joined(self.window)
            _,loss = self.forward(m, xb, yb)
            finite = bool(torch.isfinite(loss).all())
            loss.backward(); scale = 1.
        ps = [(n, p) for n,p in m.named_parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for _,
                          p in ps]) if ps else torch.zeros(0)
        if scale != 1.: flat.mul_(scale)
        # an inf or NaN anywhere makes the norm so
        return Grads(flat, finite and math.isfinite(float(flat.norm())), [n for n,_ in ps], [p.numel() for _,p in ps])

    def _window_stats(self, m):
        '''BatchNormAccumulation('window') (`batchnorm.window_stats`): the copy's BatchNorm layers normalise the
        window's micro-batches with the window's statistics, as training does (None for the other modes)'''
        from ..batchnorm.window_stats import WINDOW_MODES, WindowStats, window_bn_layers, window_is_exact
        if self.bna is None or self.bna.mode not in WINDOW_MODES: return None
        bns = window_bn_layers(m)
        ws,lf,ref = WindowStats(bns, window_is_exact(self.bna.mode, len(bns))),self.learn.loss_func,[]
        def run(j):
            xb,yb = self.batches[j]
            pred,loss = self.forward(m, xb, yb)
            if loss_reduction(lf) == 'sum': return loss
            n = self.count(xb, yb, pred, loss)
            if not ref: ref.append(Window.reference(n))
            return loss*(n/ref[0])
        ws.prepare(self.n_window, run)
        ws.on = True
        return ws

    @contextlib.contextmanager
    def _watch_recompute(self, m):
        "Does a BatchNorm layer in training mode run during the backward (activation checkpointing recomputes it)?"
        def seen(mod, inp):
            if mod.training: self.recomputed_bn = True
        hs = [mod.register_forward_pre_hook(seen) for mod in m.modules() if isinstance(mod, BatchNormBase)]
        try: yield
        finally:
            for h in hs: h.remove()

def flat_out(o):
    if isinstance(o, torch.Tensor): return o.detach().double().reshape(-1)
    if isinstance(o, (tuple, list)):
        return torch.cat([flat_out(x) for x in o]) if o else torch.zeros(0, dtype=torch.float64)
    if isinstance(o, dict): return flat_out(list(o.values()))
    return torch.zeros(0, dtype=torch.float64)
