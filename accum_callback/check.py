"""`learn.check_accumulation()`: is the accumulated gradient the big batch's on *this* Learner (its model, loss,
`GradientAccumulation` and `BatchNormAccumulation` settings, mixed precision), and if not, why? Every cause is found by
an experiment that switches the suspect off and sees the difference vanish, never guessed from the model's type. The
check works on a copy of the model: the Learner (weights, buffers, optimizer, RNG states, gradients, train/eval mode,
callbacks) is left exactly as it was."""
from __future__ import annotations
import contextlib, math, random
from dataclasses import dataclass, field

import numpy as np
import torch
from fastai.callback.fp16 import MixedPrecision
from fastai.learner import Learner
from fastai.torch_core import find_bs, to_device
from fastcore.basics import patch

from .accumulate import GradientAccumulation
from .batchnorm import BatchNormAccumulation
from .compat import BatchNormBase
from .distributed import is_fsdp, unwrap
from .losses import loss_reduction, micro_items
from .micro.loader import loader_pieces, model_device, own_loader
from .micro import (RowStates, cat_outputs, copy_module, halved, is_out_of_memory, n_pieces,
                    micro_batching, slice_batch, stateful_modules)
from .norm_layers import is_batchnorm
from .schedule import whole_number

__all__ = ['check_accumulation', 'AccumulationReport', 'CHECK_CAUSES', 'CAUSE_ADVICE']

CHECK_CAUSES = ('loss_not_mean', 'n_items', 'regularizer', 'batchnorm', 'checkpoint', 'dropout', 'train_state', 'not_per_sample',
                'nonfinite', 'unexplained')
CAUSE_ADVICE = dict(
    loss_not_mean="the loss sums over its items (e.g. reduction='sum') where its micro-batches are weighed as means: use "
                  "reduction='mean', or a torch/fastai loss class with reduction='sum' (accumulated as the sum it is)",
    n_items="the loss averages over a count other than the batch size (class weights, ignore_index, padding): pass "
            "GradientAccumulation(n_items=lambda learn: <that count of learn.yb>)",
    regularizer="a callback adds a term to the loss (fastai's RNNRegularizer: AR/TAR) that averages over every position "
                "of the padded batch, so micro-batches padded to other lengths weigh it otherwise than one batch does: "
                "small and usually harmless; micro_bs (pieces of one loader batch share its padding) or alpha=beta=0 "
                "give the big batch's gradient",
    batchnorm="BatchNorm normalises each micro-batch with its own statistics: BatchNormAccumulation('freeze') or "
              "'groupnorm' give the big batch's gradient; 'pool'/'momentum' keep the running statistics right and train "
              "on micro-batch statistics (ghost batch norm), usually harmless",
    dropout="dropout (or another layer random in training) draws other masks for micro-batches than for one batch: "
            "expected and harmless, the same distribution",
    checkpoint="BatchNorm runs inside an activation-checkpointed block: the forward recomputed in the backward updates its "
               "running statistics a second time (pytorch#96136); BatchNormAccumulation('pool') or 'momentum' count each "
               "micro-batch once",
    train_state="a layer changes its own buffers at every training forward (spectral_norm's power iteration, a "
                "running average kept in forward): micro-batches run it once each where one batch runs it once, so "
                "the window is not the large batch; expected for spectral_norm, and small",
    not_per_sample="the model mixes the samples of a batch or carries state from one batch to the next: one big batch "
                   "is another computation (expected for language models; micro_bs splits their rows exactly)",
    nonfinite="a micro-batch gave a non-finite loss or gradient: GradientAccumulation(skip_nonfinite=True) drops its window",
    unexplained="the difference stays with BatchNorm, dropout and the loss ruled out: a layer or loss this check does not "
                "model (please report it)")

# relative error that counts as exact, by the dtype the model computes in
_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}

@dataclass
class AccumulationReport:
    """What `check_accumulation` found. `exact`: the accumulated gradient is the big batch's within `tol` (the tolerance
    of `dtype`); `rel_error`: relative L2 error over the whole model; `worst`: the parameter tensors furthest off, by
    name; `causes`: names from `CHECK_CAUSES`, each found by an experiment; `errors`: what each experiment measured
    (relative; the gradient with only that suspect on, or for the loss causes the loss of the whole batch against the
    counts-weighted losses of its parts); `advice`: one line per cause; `note`: how the micro-batches were chosen where
    not as the Learner's window stands (`micro_bs='auto'` before it has cut a batch)"""
    exact: bool
    rel_error: float
    tol: float
    dtype: str
    n_step: int
    micro_sizes: list
    worst: list = field(default_factory=list)
    causes: tuple = ()
    errors: dict = field(default_factory=dict)
    advice: dict = field(default_factory=dict)
    reference: str = 'device'   # where the big batch ran: the model's device, or 'cpu' after an out-of-memory error
    note: str = ''              # how the micro-batches were chosen, where not the Learner's window as it stands

    def rows(self)->list:
        rows = [('verdict', 'exact' if self.exact else 'NOT exact'),
                ('relative error', f'{self.rel_error:.2e} (tolerance {self.tol:.0e}, {self.dtype})'),
                ('micro-batches', f"{self.n_step} of {'+'.join(map(str, self.micro_sizes))} items against one batch of {sum(self.micro_sizes)}")]
        if self.worst: rows.append(('worst tensors', ', '.join(f'{n} {e:.1e}' for n,e in self.worst)))
        for c in self.causes: rows.append((f'cause: {c}', f"{self.errors[c]:.1e}; {self.advice[c]}" if c in self.errors else self.advice[c]))
        if self.reference != 'device': rows.append(('note', f'the big batch ran on the {self.reference} (out of memory on the device)'))
        if self.note: rows.append(('note', self.note))
        return rows
    def __str__(self):
        rows = self.rows(); w = max(len(k) for k,_ in rows)
        return '\n'.join(['check_accumulation', '-'*(w+60)] + [f'{k:<{w}}  {v}' for k,v in rows])
    def _repr_markdown_(self):
        return '| check_accumulation | |\n|---|---|\n' + '\n'.join(f'| {k} | {v} |' for k,v in self.rows())
    __repr__ = __str__

# -- taking the micro-batches ----------------------------------------------------------------------------------------------
def _micro_batches(learn, n_step:int, size, shuffle:bool=False, seed:int=0)->tuple[list,list,object]:
    """The first `n_step` micro-batches of the training loader (unshuffled), each a loader batch or a piece of one, where
    each comes from: `(rows start, rows end, loader batch size)`, and that loader"""
    out,where = [],[]
    for b,w in loader_pieces(learn, size):
        out.append(b); where.append(w)
        if len(out) == n_step: return out,where,own_loader(learn)
    raise ValueError(f"`n_step`: the training loader gives only {len(out)} micro-batch(es), fewer than n_step={n_step}; "
                     "pass a smaller n_step")


def _replayed(learn)->list:
    """The Learner's callbacks that shape what the loss sees in a training step (`after_pred`: fastai's RNNCallback keeps
    the output the loss takes, a wrapper picks a model's logits; `after_loss`: RNNRegularizer's AR/TAR terms), in their
    order. Not ours, not mixed precision (the check runs autocast itself), not fastai's own GradientAccumulation."""
    from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
    return [cb for cb in learn.cbs.sorted('order')
            if not isinstance(cb, (MixedPrecision, FastaiGradientAccumulation)) and not type(cb).__module__.startswith('accum_callback')
            and any(callable(getattr(type(cb), e, None)) for e in ('after_pred', 'after_loss'))]

_STEP_KEYS = ('xb', 'yb', 'pred', 'loss', 'loss_grad', 'training')

@contextlib.contextmanager
def _sandbox(learn, cbs:list):
    "Whatever replaying `cbs`' events sets on the Learner (its step's attributes) and on the callbacks is put back after"
    saved = {k: learn.__dict__[k] for k in _STEP_KEYS if k in learn.__dict__}
    states = [(cb, dict(cb.__dict__)) for cb in cbs]
    try: yield
    finally:
        for k in _STEP_KEYS: learn.__dict__.pop(k, None)
        learn.__dict__.update(saved)
        for cb,d in states: cb.__dict__.clear(); cb.__dict__.update(d)

def _replay(learn, cbs:list, event:str):
    for cb in cbs:
        try: cb(event)
        except Exception as e:
            what = (f"raised {type(e).__name__}: the check cannot follow a callback that cancels a micro-batch; run it "
                    f"with that callback removed (`with learn.removed_cbs(cb): learn.check_accumulation()`)"
                    if type(e).__name__.startswith('Cancel') else f"failed: {e}")
            raise RuntimeError(f"check_accumulation: replaying `{type(cb).__name__}.{event}` (what training runs between "
                               f"the model and the backward) on the check's copy {what}") from e

def _split_xy(learn, b):
    i = getattr(learn.dls, 'n_inp', 1 if len(b) == 1 else len(b)-1)
    return tuple(b[:i]),tuple(b[i:])

class _View:
    "What `n_items(learn)` reads: this micro-batch's `xb`, `yb`, `pred`, `loss`; anything else from the Learner"
    def __init__(self, learn, **kw): self.__dict__.update(kw); self._learn = learn
    def __getattr__(self, k): return getattr(self.__dict__['_learn'], k)

# -- the experiments ---------------------------------------------------------------------------------------------------------
class Runner:
    """Gradients and outputs of a copy of the model, accumulated over micro-batches or in one batch, under switches.

    Micro-batches are addressed by index into `batches`; `where[i]` says where micro-batch i comes from. Two sets of them
    serve the output experiments: `exp` (the first two, which show a layer that mixes samples, or, on a model with
    per-row state cut in pieces, up to the first piece of the second loader batch, where the state carries over) and
    `clean` (the first micro-batch in two halves, each from its own rows of a stateful model's state: a set where one
    batch and its parts compute the same on a per-sample model, so that BatchNorm's and dropout's effects show alone)"""
    def __init__(self, learn, batches, model, ga, bna, where:list, dl=None):
        self.learn,self.ga,self.bna,self.dl = learn,ga,bna,dl
        self.model0,self.replay = model,_replayed(learn)
        self.stateful = any(map(any, stateful_modules(model)))   # splittable or not: its state is copied per pass
        self.load(batches, where)
        self.model = copy_module(model)
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.steps = [(m, m.renorm_steps) for m in self.model.modules() if hasattr(m, 'renorm_steps')]   # Batch Renorm's ramp
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        amp = getattr(mp, 'amp_mode', None) if mp is not None else None
        self.autocast = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(str(getattr(amp, 'value', amp)).lower().replace('amptype.', ''))
        # fastai's MixedPrecision autocasts on CUDA only (`autocast('cuda')`): a model on the CPU trains in its own dtype
        if model_device(model).type != 'cuda': self.autocast = None
        p = next(iter(model.parameters()), None)
        self.dtype = self.autocast or (p.dtype if p is not None else torch.float32)
        self.loss_dtype = None   # the dtype the loss came out in (fastai's flattened losses give float32 for float64 input)
        self.recomputed_bn = False   # a BatchNorm forward ran during a backward (activation checkpointing)
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        self.loss_terms = True   # replay the callbacks' `after_loss` (RNNRegularizer's AR/TAR); off for the regularizer experiment

    def load(self, batches:list, where:list):
        "The micro-batches to run (a window), where each comes from, and the experiments' sets of them"
        self.batches = [_split_xy(self.learn, b) for b in batches]
        self.where = list(where)
        self.n_window = len(self.batches)   # the window's micro-batches; the halves below come after them
        # pieces of loader batches on a model with per-row state: each starts from its own rows, as under micro_bs
        self.cut_rows = self.stateful and any((s, e) != (0, n) for s,e,n in self.where)
        starts = [i for i,(s,_,_) in enumerate(self.where) if s == 0 and i > 0]
        self.exp = list(range(starts[0]+1 if self.cut_rows and starts else min(2, len(self.batches))))
        s,e,n = self.where[0]
        if e-s >= 4:   # (halves of two items at least: BatchNorm cannot train on one)
            m = s + (e-s)//2
            xb,yb = self.batches[0]
            self.batches += [(slice_batch(xb, 0, m-s), slice_batch(yb, 0, m-s)), (slice_batch(xb, m-s, e-s), slice_batch(yb, m-s, e-s))]
            self.where += [(s, m, n), (m, e, n)]
            self.clean = [self.n_window, self.n_window+1]
        else: self.clean = self.exp

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
        torch.set_rng_state(self.rng[0])
        if self.rng[1] is not None: torch.cuda.set_rng_state_all(self.rng[1])
        return self.model

    def modes(self, m, bn:bool, drop:bool):
        """Training mode as the Learner trains (`bn`, `drop` True), with BatchNorm's batch statistics off (`bn` False: its
        running statistics, as in eval) or every other train-mode behaviour off (`drop` False: dropout, drop-path...)"""
        m.train(drop)
        frozen = self.bna is not None and self.bna.mode == 'freeze'
        for mod in m.modules():
            if isinstance(mod, BatchNormBase): mod.train(bn and not frozen)   # BatchNorm, SyncBatchNorm, Batch Renorm

    def _ctx(self, m):
        dev = model_device(m).type
        return torch.autocast(dev, dtype=self.autocast) if self.autocast is not None else torch.autocast(dev, enabled=False)

    def forward(self, m, xb, yb):
        """(prediction, loss) as the Learner's training step computes them: the model's output through the callbacks'
        `after_pred`, the loss through their `after_loss` (see `_replayed`)"""
        lf = self.learn.loss_func
        with self._ctx(m):
            raw = m(*xb)
            if not self.replay: return raw,lf(raw, *yb)
        L = self.learn
        with _sandbox(L, self.replay):
            pred = self._pred(raw, xb, yb)
            with self._ctx(m): L.loss_grad = lf(pred, *yb)
            L.loss = L.loss_grad.clone()
            if self.loss_terms: _replay(L, self.replay, 'after_loss')
            return pred,L.loss_grad

    def _pred(self, raw, xb, yb):
        "The model's output `raw` through the callbacks' `after_pred`, what the loss sees (inside `_sandbox`)"
        L = self.learn
        L.xb,L.yb,L.pred,L.training = xb,yb,raw,True
        _replay(L, self.replay, 'after_pred')
        return L.pred

    def _seen(self, raw, xb, yb):
        "What the loss sees of the model's output `raw`, the Learner put back after"
        if not self.replay: return raw
        with _sandbox(self.learn, self.replay): return self._pred(raw, xb, yb)

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
            raise ValueError("check_accumulation: the micro-batches have different shapes (padded to other lengths?) and "
                             "are not whole loader batches, so one batch of them cannot be formed: pass an `n_step` of "
                             "whole loader batches")
        n = sum(e-s for s,e,_ in (self.where[i] for i in idxs))
        b = next(iter(self.dl.new(bs=n, shuffle=False, drop_last=False)))   # (its order: the loader's own, unshuffled)
        return _split_xy(self.learn, to_device(b, model_device(self.model0)))

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

    def grads(self, accumulate:bool, bn=True, drop=True)->tuple[torch.Tensor,bool]:
        "(flat gradient, all finite) as the Learner's step would see it, or of the one big batch (names in `self.names`)"
        m = self.fresh(); self.modes(m, bn, drop)
        for p in m.parameters(): p.grad = None
        lf,finite = self.learn.loss_func,True
        summed = loss_reduction(lf) == 'sum'
        if accumulate:
            items,ref = 0.,None
            for xb,yb in self.pieces(m, self.window):
                pred,loss = self.forward(m, xb, yb)
                self.loss_dtype = loss.dtype
                n = self.count(xb, yb, pred, loss)
                if ref is None: ref = max(n, 1.)
                finite = finite and bool(torch.isfinite(loss).all())
                with self._watch_recompute(m): (loss if summed else loss*(n/ref)).backward()
                items += n
            scale = 1. if summed else ref/items
        else:
            xb,yb = self.joined(self.window)
            _,loss = self.forward(m, xb, yb)
            finite = bool(torch.isfinite(loss).all())
            loss.backward(); scale = 1.
        ps = [(n, p) for n,p in m.named_parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for _,p in ps]) if ps else torch.zeros(0)
        if scale != 1.: flat.mul_(scale)
        self.names,self.sizes = [n for n,_ in ps],[p.numel() for _,p in ps]
        return flat,finite and math.isfinite(float(flat.norm()))   # an inf or NaN anywhere makes the norm so

    @contextlib.contextmanager
    def _watch_recompute(self, m):
        "Does a BatchNorm layer in training mode run during the backward (activation checkpointing recomputes it)?"
        def seen(mod, inp):
            if mod.training: self.recomputed_bn = True
        hs = [mod.register_forward_pre_hook(seen) for mod in m.modules() if isinstance(mod, BatchNormBase)]
        try: yield
        finally:
            for h in hs: h.remove()

    @torch.no_grad()
    def train_effects(self, idxs)->tuple[bool,bool]:
        """What makes training mode differ, besides BatchNorm: `(random, state)`. random: the output of the same forward
        changes with the RNG (dropout, drop-path); state: a forward changes buffers outside BatchNorm (spectral_norm's
        power iteration)"""
        xb,yb = self.joined(idxs)
        outs,state = [],False
        for shift in (False, True):
            m = self.fresh(); self.modes(m, False, True)
            if shift:   # another draw of every generator the forward may use
                torch.rand(1)
                if model_device(m).type == 'cuda': torch.rand(1, device=model_device(m))
            bufs = [(b, b.detach().clone()) for mod in m.modules() if not isinstance(mod, BatchNormBase) for b in mod.buffers(recurse=False)]
            with self._ctx(m): outs.append(_flat_out(self._seen(m(*xb), xb, yb)))
            state = state or any(not torch.equal(b, v) for b,v in bufs)
        return not torch.equal(*outs),state

    @torch.no_grad()
    def outputs(self, idxs, bn:bool, drop:bool, keep:bool=False)->float:
        """Relative difference between what the loss sees (the output through the callbacks' `after_pred`) of the
        micro-batches `idxs` run one after the other and of one batch of them"""
        whole = self.whole(idxs, bn, drop)
        m = self.fresh(); self.modes(m, bn, drop)
        with self._ctx(m): preds = [self._seen(m(*xb), xb, yb) for xb,yb in self.pieces(m, idxs)]
        if keep: self.quiet_preds = preds
        return _rel(_flat_out(cat_outputs(preds)), _flat_out(whole))

    @torch.no_grad()
    def whole(self, idxs, bn:bool, drop:bool):
        "What the loss sees of one batch of the micro-batches `idxs`"
        m = self.fresh(); self.modes(m, bn, drop)
        xb,yb = self.joined(idxs)
        with self._ctx(m): return self._seen(m(*xb), xb, yb)

    @torch.no_grad()
    def loss_split(self)->tuple[float,float]:
        """The loss of the experiment's micro-batches together against their own losses, on the same predictions (those
        of the deterministic `outputs(exp, False, False)` run): (error of the counts-weighted mean the Learner uses, error
        of a plain sum)"""
        lf,bs,(_,yb_all) = self.learn.loss_func,[self.batches[i] for i in self.exp],self.joined(self.exp)
        big = float(lf(cat_outputs(self.quiet_preds), *yb_all))   # the same predictions, as one batch
        ls,ns = [],[]
        for p,(xb,yb) in zip(self.quiet_preds, bs):
            ls.append(float(lf(p, *yb))); ns.append(self.count(xb, yb, p, None))
        if loss_reduction(lf) == 'sum': mean = sum(ls)
        else: mean = sum(l*n for l,n in zip(ls, ns) if n > 0)/max(sum(ns), 1e-30)
        d = max(abs(big), 1e-30)
        return abs(mean-big)/d, abs(sum(ls)-big)/d

    def regularizer(self)->tuple[float,float]:
        """The accumulated gradient against the big batch's with BatchNorm and dropout quiet, with the callbacks' loss
        terms (AR/TAR) and without them"""
        errs = []
        for on in (True, False):
            self.loss_terms = on
            try: errs.append(_rel(self.grads(True, bn=False, drop=False)[0], self.grads(False, bn=False, drop=False)[0]))
            finally: self.loss_terms = True
        return tuple(errs)

def _flat_out(o):
    if isinstance(o, torch.Tensor): return o.detach().double().reshape(-1)
    if isinstance(o, (tuple, list)): return torch.cat([_flat_out(x) for x in o]) if o else torch.zeros(0, dtype=torch.float64)
    if isinstance(o, dict): return _flat_out(list(o.values()))
    return torch.zeros(0, dtype=torch.float64)

def _worst(names, sizes, a, b, tol, k=3)->list:
    """The `k` parameter tensors whose gradients are furthest off (relative), above `tol`. A tensor whose gradient is, in
    both, below `tol` of the whole gradient's norm is not ranked: its relative error is rounding noise (a bias before a
    BatchNorm layer has no gradient but for rounding, whose ratio moved from 0.94 to 0.96 with the number of threads)"""
    if not names: return []
    d = torch.stack([x.norm() for x in (a-b).split(sizes)])
    nb,na = torch.stack([x.norm() for x in b.split(sizes)]),torch.stack([x.norm() for x in a.split(sizes)])
    e,floor = (d/nb.clamp_min(1e-30)).tolist(),tol*float(b.norm())
    judged = [i for i in range(len(e)) if max(float(na[i]), float(nb[i])) > floor or not math.isfinite(e[i])]
    return [(names[i], e[i]) for i in sorted(judged, key=lambda i: -e[i] if math.isfinite(e[i]) else -math.inf)[:k] if e[i] > tol]

def _rel(a, b)->float:
    "Relative L2 error of `a` against `b` (inf where either is not finite)"
    if not b.numel(): return 0.
    d,n = float((a-b).norm()),float(b.norm())
    return d/max(n, 1e-30) if math.isfinite(d) and math.isfinite(n) else math.inf

# -- the check ------------------------------------------------------------------------------------------------------------------
def _run_check(learn, n_step:int|None=None)->AccumulationReport:
    """Compare the gradient `learn` accumulates over `n_step` micro-batches of its training loader with the gradient of
    one batch of exactly those samples, and say why they differ (see `AccumulationReport`). Changes nothing."""
    ga = next((cb for cb in learn.cbs if isinstance(cb, GradientAccumulation)), None)
    bna = next((cb for cb in learn.cbs if isinstance(cb, BatchNormAccumulation)), None)
    mb = micro_batching(learn)
    size,note = (mb.size if mb is not None else None),''
    if n_step is None:
        n_step = 4
        if ga is not None:
            try: n_step = ga.window_n_step
            except Exception: pass
            bs = getattr(learn.dls.train, 'bs', None)
            if mb is not None and mb.auto and isinstance(bs, int) and bs >= 2 and (size is None or size >= bs):
                # 'auto' has not cut a loader batch yet: checking one uncut batch against itself would say nothing.
                # Check what its first out-of-memory error would run: each loader batch cut at the halved size
                size = halved(bs)
                n_step = n_step*n_pieces(bs, size)
                note = f"micro_bs='auto' has not cut a batch yet: checked at {size}, what its first halving runs"
    n_step = whole_number(n_step, 'n_step')
    if n_step == 1 and not note: note = "one micro-batch against itself: nothing is accumulated (pass n_step >= 2 to check a window)"
    if is_fsdp(learn.model):
        raise ValueError("check_accumulation: the model is sharded with FSDP2; run the check before sharding it (on one "
                         "process), or under DDP, where each rank checks its own samples")
    saved = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             random.getstate(), np.random.get_state())
    try:
        batches,where,dl = _micro_batches(learn, n_step, size)
        model = unwrap(learn.model)   # under DDP each rank checks its own samples, without collectives
        if bna is not None and bna.converts and any(is_batchnorm(m) for m in model.modules()):
            model = bna.convert(copy_module(model))   # as training will convert it, on a copy
        rep = _check(learn, batches, model, ga, bna, n_step, where, dl)
        rep.note = note
        return rep
    finally:
        torch.set_rng_state(saved[0])
        if saved[1] is not None: torch.cuda.set_rng_state_all(saved[1])
        random.setstate(saved[2]); np.random.set_state(saved[3])

def _check(learn, batches, model, ga, bna, n_step, where, dl=None)->AccumulationReport:
    r = Runner(learn, batches, model, ga, bna, where, dl)
    sizes = [find_bs(b) for b in batches]
    acc,fa = r.grads(True)
    # judged at the precision training really runs in: the model's (or autocast's), or the loss's where coarser
    dtype = max((r.dtype, r.loss_dtype or r.dtype), key=lambda d: _TOL.get(d, 1e-5))
    tol = _TOL.get(dtype, 1e-5)
    ref = 'device'
    try: big,fb = r.grads(False)
    except Exception as e:   # the big batch does not fit where the micro-batches do: compute it on the CPU
        if not is_out_of_memory(e): raise
        r.model0,r.model = copy_module(r.model0).cpu(),None
        r.batches = [to_device(b, 'cpu') for b in r.batches]; r.buffers = []; r.stateful = True
        try: big,fb = r.grads(False)
        except Exception as e:
            if not is_out_of_memory(e): raise
            raise RuntimeError(f"check_accumulation: one batch of the {sum(sizes)} items of n_step={n_step} micro-batches "
                               "runs out of memory on the device and on the CPU: pass a smaller `n_step`") from None
        big = big.to(acc.device); ref = 'cpu'
    err = _rel(acc, big)
    rep = AccumulationReport(exact=bool(fa and fb and err <= tol), rel_error=err, tol=tol, dtype=str(dtype).replace('torch.', ''),
                             n_step=n_step, micro_sizes=sizes, worst=_worst(r.names, r.sizes, acc, big, tol), reference=ref)
    # BatchNorm recomputed in the backward (checkpointing) counts its statistics twice: named, exact gradient or not
    recount = r.recomputed_bn and not (bna is not None and bna.mode in ('pool', 'momentum', 'freeze', 'groupnorm'))
    if rep.exact:
        if recount: rep.causes,rep.advice = ('checkpoint',),{'checkpoint': CAUSE_ADVICE['checkpoint']}
        return rep
    causes,errors = (['checkpoint'] if recount else []),{}
    if not (fa and fb):
        causes.append('nonfinite'); errors['nonfinite'] = math.inf
    else:
        # a model that mixes the samples of a batch, or carries state from one loader batch to the next
        quiet = r.outputs(r.exp, bn=False, drop=False, keep=True)
        if quiet > tol: causes.append('not_per_sample'); errors['not_per_sample'] = quiet
        # BatchNorm and dropout, each switched on alone on the halves of the first micro-batch (where the parts and the
        # whole compute the same otherwise): a difference well above that of the quiet run is theirs
        quiet_clean = r.outputs(r.clean, bn=False, drop=False) if r.clean != r.exp else quiet
        has_bn = any(isinstance(m, BatchNormBase) for m in model.modules()) and not (bna is not None and bna.mode == 'freeze')
        if has_bn:
            e = r.outputs(r.clean, bn=True, drop=False)
            if e > max(tol, 10*quiet_clean): causes.append('batchnorm'); errors['batchnorm'] = e
        train_mode = _rel(_flat_out(r.whole(r.clean, bn=False, drop=True)), _flat_out(r.whole(r.clean, bn=False, drop=False))) > 0
        def train_causes(e):
            "Which layers acting otherwise in training: drawn masks (dropout), or buffers a forward changes (spectral_norm)"
            random_,state = r.train_effects(r.clean)
            for c,on in (('dropout', random_), ('train_state', state)):
                if on: causes.append(c); errors[c] = e
            return random_ or state
        if train_mode:
            e = r.outputs(r.clean, bn=False, drop=True)   # do the parts differ from the whole in training mode?
            if e > max(tol, 10*quiet_clean) and not train_causes(e): causes.append('unexplained'); errors['unexplained'] = e
        mean_err,sum_err = r.loss_split()
        if mean_err > tol:
            c = 'loss_not_mean' if sum_err <= tol else 'n_items'
            causes.append(c); errors[c] = mean_err
        if r.adds_loss_terms:   # AR/TAR over padded positions: the difference goes with the terms
            with_terms,without = r.regularizer()
            if with_terms > max(tol, 10*without): causes.append('regularizer'); errors['regularizer'] = with_terms
        if not [c for c in causes if c != 'checkpoint']:   # before calling it unexplained: samples mixed anywhere in
            whole = r.outputs(r.window, bn=False, drop=False) if r.window != r.exp else quiet   # the window? training mode?
            if whole > tol: causes.append('not_per_sample'); errors['not_per_sample'] = whole
            elif not (train_mode and train_causes(err)): causes.append('unexplained'); errors['unexplained'] = err
    rep.causes = tuple(c for c in CHECK_CAUSES if c in causes)
    rep.errors = {c: errors[c] for c in rep.causes if c in errors}
    rep.advice = {c: CAUSE_ADVICE[c] for c in rep.causes}
    return rep

@patch
def check_accumulation(self:Learner,
    n_step:int|None=None, # micro-batches to accumulate (default: the window of the Learner's GradientAccumulation, else 4; see the docs for 'auto')
)->AccumulationReport:
    """Is the gradient this Learner accumulates over `n_step` micro-batches of its training loader the gradient of one
    batch of exactly those samples? If not, why (`AccumulationReport.causes`)? Works on a copy: changes nothing"""
    return _run_check(self, n_step)

def check_accumulation(   # the module-level name (the @patch above put the method on Learner)
    learn:Learner, # the Learner to check, with its GradientAccumulation / BatchNormAccumulation / MixedPrecision
    n_step:int|None=None, # micro-batches to accumulate (default: the window of the Learner's GradientAccumulation, else 4; see the docs for 'auto')
)->AccumulationReport:
    "`learn.check_accumulation(n_step)` as a function"
    return _run_check(learn, n_step)
