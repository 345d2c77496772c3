"""`learn.noise_scale()`: the gradient noise scale measured once, before training, at the current weights, on the
replay engine's copy of the model (every micro-batch of at most a quarter of the set, pooled, with a bootstrap 95%
interval over groups; or the windows' two-batch-size estimator), and its `NoiseScaleReport`. The callback that measures
it during training, its estimators and the schedule that grows the window with it are in `noise/scale.py`."""
from __future__ import annotations
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import patch

from ..window.accumulate import GradientAccumulation
from ..batchnorm.callback import BatchNormAccumulation
from ..micro import micro_size, n_pieces
from ..core.loaders import batch_sizes, own_loader
from ..micro.loader import loader_pieces
from ..core.distributed import is_fsdp
from ..core.losses import loss_reduction
from ..window.state import Window
from ..compat.torch import rngs_kept
from ..check.replay import Replay, training_model
from ..core.args import flag, whole_number
from .scale import noise_estimates, ratio_of, sq_norm

__all__ = ['NoiseScaleReport']

# -- learn.noise_scale(): one measurement before training
# ---------------------------------------------------------------
@dataclass
class NoiseScaleReport:
    """What `learn.noise_scale()` measured at the current weights: `b_simple` (ratio of the mean estimates of tr(S) and
    |G|^2 over `n_windows` windows), `interval` (95%, bootstrap over the windows), `g2` and `trace`, the micro-batch and
    window sizes in items (`b`, `B`), and what to accumulate to for an effective batch of B_simple with this loader:
    `target_bs` and `n_step` (micro-batches of the loader's batch). Where no estimate can be made (the mean gradient
    lost in the noise, no finite window) `target_bs` and `n_step` are None and `reason` says why; `n_skipped`: windows
    left out because a loss or gradient in them was not finite"""
    b_simple: float
    interval: tuple
    g2: float
    trace: float
    b: float
    B: float
    n_windows: int
    target_bs: int|None
    n_step: int|None
    per_window: list = field(default_factory=list)
    reason: str = ''
    n_skipped: int = 0
    items_read: int = 0
    set_items: int = 0
    what: str = 'windows'   # what `n_windows` counts: windows, or the pooled measurement's groups of micro-batches

    def __str__(self):
        lo,hi = self.interval
        skipped = f", {self.n_skipped} non-finite left out" if self.n_skipped else ''
        f = self.items_read/self.set_items if self.set_items else 0
        share = f"{f:.0%} of the training set" if f <= 1 else f"{f:.2g}x the training set (windows repeat samples)"
        read = f"{self.items_read} items, {share}" if self.set_items else ''
        suggested = (f"target_bs={self.target_bs} (n_step={self.n_step} micro-batches of the loader's batch)"
                     if self.target_bs is not None else f"nothing: {self.reason}")
        if self.target_bs is not None and self.target_bs <= self.b:   # one micro-batch is already that large
            suggested = f"no accumulation: B_simple is at most one micro-batch of {self.b:.3g} items (n_step=1)"
        return '\n'.join(['noise_scale', '-'*72,
            (f"B_simple          {self.b_simple:.3g} items (95% {lo:.3g} to {hi:.3g}, {self.n_windows} "
             f"{self.what}{skipped})"
             if math.isfinite(self.b_simple) else
             f"B_simple          not estimated ({self.n_windows} {self.what}{skipped})" + (f": above {lo:.3g} items at "
                                                                                           "95%" if lo > 0 else '')),
            f"|G|^2, tr(S)      {self.g2:.3g}, {self.trace:.3g}",
            f"measured with     micro-batches of {self.b:.3g} items " + (f"in windows of {self.B:.3g}"
                                                                         if self.what == 'windows' else 'pooled')
            + (f"; read {read}" if read else ''),
            f"suggested         {suggested}"])
    __repr__ = __str__

def _ratio(g2, tr)->float:
    """tr(S)/|G|^2 of the windows' mean estimates: nan where no noise is measured, inf where the mean gradient is lost
    in it"""
    g,t = float(np.mean(g2)),float(np.mean(tr))
    return ratio_of(g, t)

@patch
def noise_scale(self:Learner,
    # windows to measure (each a training window's compute, no step); None: as many as `max_items` allows, fewer once
    # the interval is narrow
    n_windows:int|None=None,
    # micro-batches a window (default: 8, fewer where `max_items` would hold under 8 windows; at least 2)
    n_step:int|None=None,
    seed:int=0, # which shuffled windows of the training loader
    # BatchNorm normalising with its running statistics and dropout off: only the data's noise is measured
    quiet:bool=True,
    # items to read at most with `n_windows=None` (default: a quarter of the training set, at least 4 windows of 2
    # micro-batches)
    max_items:int|None=None,
    # with `n_windows=None`: stop once the 95% interval's high end is within this factor of its low end
    rel_width:float=1.5,
)->NoiseScaleReport:
    """Measure the gradient noise scale B_simple at the current weights over windows of the training loader (shuffled,
    with `seed`), on a copy of the model: no step, and the Learner's weights, optimizer, RNG states and BatchNorm
    statistics are left as they were. `quiet` (the default): BatchNorm layers normalise with their running statistics
    (training couples a micro-batch's samples through its statistics, which biases the estimate) and dropout is off (its
    noise is not the data's); `quiet=False` measures the model as it trains. By default it reads at most a quarter of
    the training set (`max_items`) and stops earlier once the 95% interval is narrow (`rel_width`); `n_windows` measures
    that many, and the report says when they read more items than the set holds. Returns the estimate with its interval
    and the `target_bs`/`n_step` that accumulate an effective batch of B_simple, or none, with the reason, where it
    cannot be estimated"""
    ga = next((cb for cb in self.cbs if isinstance(cb, GradientAccumulation)), None)
    if n_windows is not None: n_windows = whole_number(n_windows, 'n_windows', lo=2)
    if max_items is not None: max_items = whole_number(max_items, 'max_items', lo=1)
    if isinstance(rel_width, bool) or not isinstance(rel_width, (int, float)) or not rel_width > 1:
        raise ValueError("`rel_width` must be a number > 1 (the interval's high end over its low end), got "
                         f"{rel_width!r}")
    if n_step is not None: n_step = whole_number(n_step, 'n_step', lo=2)
    if is_fsdp(self.model): raise ValueError("noise_scale: the model is sharded with FSDP2; measure before sharding it")
    with rngs_kept():
        size = micro_size(self)
        dl = own_loader(self, shuffle=True, seed=seed)
        per_epoch = sum(n_pieces(n, size) if size else 1 for n in batch_sizes(dl))
        if per_epoch < 1:
            raise ValueError(f"noise_scale: the training loader gives no full batch of {getattr(dl, 'bs', '?')} items "
                             f"(the training set holds {getattr(dl, 'n', '?')}): nothing to measure; use a smaller "
                             "batch size")
        piece = size or getattr(dl, 'bs', None) or 1
        set_items = getattr(dl, 'n', None) or per_epoch*piece
        bna = next((cb for cb in self.cbs if isinstance(cb, BatchNormAccumulation)), None)
        model = training_model(self, bna)
        if n_windows is None:   # a budget of items, pooled: every pair of micro-batches measures |G|^2
            budget = max_items if max_items is not None else set_items//4
            n_micro = max(8, budget//piece)
            n_step = n_step or max(1, math.ceil(n_micro/8))   # micro-batches a group: up to 8 groups to resample
            stream = loader_pieces(self, size, shuffle=True, seed=seed, epochs=-(-n_micro//max(per_epoch, 1)))
            pool = _Pooled(self, model, ga, bna, dl, quiet=flag(quiet, 'quiet'))
            while pool.n_micro + n_step <= max(n_micro, 2*n_step):
                pool.add_group([next(stream) for _ in range(n_step)])
                if len(pool.groups) >= 4 and pool.narrow(seed, rel_width): break
            rep = pool.report(seed, getattr(self.dls.train, 'bs', None))
        else:
            # B - b large: a steadier |G|^2
            if n_step is None: n_step = max(8, ga.window_n_step if ga is not None else 8)
            stream = loader_pieces(self, size, shuffle=True, seed=seed, epochs=-(-n_windows*n_step//max(per_epoch, 1)))
            r,per = None,[]
            for i in range(n_windows):   # one window in memory at a time
                bs,where = zip(*[next(stream) for _ in range(n_step)])
                if r is None: r = Replay(self, list(bs), model, ga, bna, list(where), dl)
                else: r.load(list(bs), list(where))
                per.append(_window_norms(r, list(range(n_step)), quiet=flag(quiet, 'quiet')))
            rep = _report(per, len(per), seed, getattr(self.dls.train, 'bs', None))
            rep.items_read = int(round(sum(p['B'] for p in per)))
    rep.set_items = int(set_items)
    return rep

class _Pooled:
    """Every micro-batch read, pooled (the default of `learn.noise_scale()`): micro-batch i's summed gradient s_i over
    n_i items has E<s_i, s_l> = n_i n_l |G|^2 for i != l and E|s_i|^2 = n_i^2 |G|^2 + n_i tr(S), so with N = sum n_i,
    Q = sum n_i^2, A = sum |s_i|^2 and T = sum s_i:

        |G|^2 ~ (|T|^2 - A) / (N^2 - Q)        tr(S) ~ (A - Q |G|^2) / N

    (the window estimator's, over one window of everything read: every pair of micro-batches measures the mean
    gradient). The micro-batches are read in groups; the groups' summed gradients (one flat copy each) and their inner
    products are kept, so the bootstrap resamples groups with the pairs inside a group counted once, and a group never
    pairs with itself"""
    def __init__(self, learn, model, ga, bna, dl, quiet:bool):
        self.learn,self.model,self.ga,self.bna,self.dl,self.quiet = learn,model,ga,bna,dl,quiet
        self.r,self.groups,self.n_micro,self.b = None,[],0,[]
        self.vecs,self.gram = [],[]   # each group's summed gradient (flat, float32), and <S_j, S_k> for k <= j

    def add_group(self, pieces:list):
        bs,where = zip(*pieces)
        if self.r is None: self.r = Replay(self.learn, list(bs), self.model, self.ga, self.bna, list(where), self.dl)
        else: self.r.load(list(bs), list(where))
        r = self.r
        m = r.fresh(); r.modes(m, not self.quiet, not self.quiet)
        ps = [p for p in m.parameters() if p.requires_grad]
        S,N,Q,A = None,0.,0.,0.
        for xb,yb in r.pieces(m, list(range(len(pieces)))):
            for p in ps: p.grad = None
            pred,loss = r.forward(m, xb, yb)
            n = r.count(xb, yb, pred, loss)
            w = Window(); w.begin(n, loss_reduction(r.learn.loss_func) == 'sum')
            (loss*w.loss_weight(n)).backward()
            g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in ps])
            s = g*float(w.mean_factor(n)*n)   # the micro-batch's summed gradient
            A += float(torch.dot(s, s)); N += n; Q += n*n
            S = s if S is None else S.add_(s)
            self.b.append(n)
        self.gram.append([float(torch.dot(S, v)) for v in self.vecs] + [float(torch.dot(S, S))])
        self.vecs.append(S)
        self.groups.append((N, Q, A))
        self.n_micro += len(pieces)

    def estimates(self, c)->tuple:
        "|G|^2 and tr(S) of the groups weighted by `c` (how often each is drawn; ones: the estimate itself)"
        g = len(self.groups)
        N,Q,A = (np.array([x[i] for x in self.groups]) for i in range(3))
        M = np.zeros((g, g))
        for j,row in enumerate(self.gram): M[j, :j+1] = row; M[:j+1, j] = row
        within_pairs = np.diag(M) - A   # sum over i != l inside a group of <s_i, s_l>
        cross = c @ M @ c - (c*c) @ np.diag(M)
        num = cross + c @ within_pairs
        den = (c @ N)**2 - (c*c) @ (N*N) + c @ (N*N - Q)
        with np.errstate(divide='ignore', invalid='ignore'):   # (a resample of one group has no pair across groups)
            g2 = num/den
            return g2,(c @ A - (c @ Q)*g2)/(c @ N)

    def interval(self, seed:int, n_boot:int=1000)->tuple:
        g = len(self.groups)
        rng = np.random.default_rng(seed)
        return _central95([ratio_of(*self.estimates(np.bincount(rng.integers(0, g, g), minlength=g).astype(float)))
                           for _ in range(n_boot)])

    def narrow(self, seed:int, rel_width:float)->bool:
        lo,hi = self.interval(seed, 200)
        return 0 < lo and math.isfinite(hi) and hi <= rel_width*lo

    def report(self, seed:int, bs)->NoiseScaleReport:
        g = len(self.groups)
        g2,tr = self.estimates(np.ones(g))
        N = sum(x[0] for x in self.groups)
        b = 1/float(np.mean([1/n for n in self.b]))
        per = [dict(zip(('items', 'sq_items', 'sq_norms'), x)) for x in self.groups]
        if not (math.isfinite(g2) and math.isfinite(tr)):
            return NoiseScaleReport(b_simple=math.nan, interval=(math.nan, math.nan), g2=math.nan, trace=math.nan, b=b,
                                    B=N,
                                    n_windows=g, target_bs=None, n_step=None, per_window=per, items_read=int(round(N)),
                                    reason="a loss or gradient was not finite")
        rep = _suggest(ratio_of(g2, tr), self.interval(seed), g2, tr, b, N, g, bs, per, 0,
                       f"{g} groups of {N/g:.3g} items")
        rep.items_read,rep.what = int(round(N)),'groups, pooled'
        return rep

def _central95(boots:list)->tuple:
    "The 2.5% and 97.5% points of bootstrap ratios (a resample with no noise measured, nan, sorts last)"
    boots = sorted(boots, key=lambda v: (math.isnan(v), v))
    return boots[int(0.025*len(boots))],boots[int(0.975*len(boots))-1]

def _interval(g2, tr, seed:int, n_boot:int=1000)->tuple:
    "The bootstrap's 95% interval of the ratio of the windows' mean estimates (nan-free resamples first)"
    g2,tr = np.asarray(g2, dtype=float),np.asarray(tr, dtype=float)
    ok = np.isfinite(g2) & np.isfinite(tr)
    g2,tr = g2[ok],tr[ok]
    n = len(g2)
    if n < 2: return math.nan,math.nan
    rng = np.random.default_rng(seed)
    return _central95([_ratio(g2[i], tr[i]) for i in (rng.integers(0, n, n) for _ in range(n_boot))])

def _report(per:list, n_windows:int, seed:int, bs)->NoiseScaleReport:
    """The estimate over the finite windows of `per`, its bootstrap interval, and a suggestion only where one can be
    defended"""
    ok = [p for p in per if math.isfinite(p['g2']) and math.isfinite(p['trace'])]   # (training skips such windows too)
    n_skipped = len(per) - len(ok)
    b = float(np.mean([p['b'] for p in per])) if per else math.nan
    B = float(np.mean([p['B'] for p in per])) if per else math.nan
    if len(ok) < 2:
        return NoiseScaleReport(b_simple=math.nan, interval=(math.nan, math.nan), g2=math.nan, trace=math.nan, b=b, B=B,
                                n_windows=len(ok), target_bs=None, n_step=None, per_window=per, n_skipped=n_skipped,
                                reason=f"{n_skipped} of {len(per)} windows gave a non-finite loss or gradient, fewer "
                                       "than 2 are left")
    g2 = np.array([p['g2'] for p in ok]); tr = np.array([p['trace'] for p in ok])
    return _suggest(_ratio(g2, tr), _interval(g2, tr, seed), float(g2.mean()), float(tr.mean()), b, B, len(ok), bs, per,
                    n_skipped, f"{len(ok)} windows of {B:.3g} items")

def _suggest(est, interval, g2, tr, b, B, n, bs, per, n_skipped, what:str)->NoiseScaleReport:
    "The report, with a suggestion only where the interval defends one, else the reason in words"
    target,reason = None,''
    if math.isfinite(est) and est > 0 and math.isfinite(interval[1]): target = max(1, round(est))
    elif not tr > 0: reason = "no gradient noise was measured (tr(S) <= 0): the gradients agree"
    else:   # |G|^2 <= 0, or resamples where it is: the mean gradient is not told from the noise
        reason = (f"the mean gradient is lost in the noise (|G|^2 {g2:.3g} over {what}, not above 0 at 95%): "
                  f"B_simple is above {interval[0]:.3g} items; more items (`max_items`) tell more")
    per_unit = bs or b
    return NoiseScaleReport(b_simple=est, interval=interval, g2=g2, trace=tr, b=b, B=B, n_windows=n, target_bs=target,
                            n_step=None if target is None else max(1, math.ceil(target/per_unit)), per_window=per,
                            reason=reason, n_skipped=n_skipped)

def _window_norms(r:Replay, idxs:list, quiet:bool=False)->dict:
    """One window of the replayed copy, micro-batch by micro-batch as training runs it and by the window's rule
    (`quiet`: BatchNorm on its running statistics, dropout off): the mean of the micro-batches' squared mean-gradient
    norms, the squared norm of the window's mean gradient, and the estimates from them"""
    m = r.fresh(); r.modes(m, not quiet, not quiet)
    ps = [p for p in m.parameters() if p.requires_grad]
    acc,small,inv_b,w = None,[],[],Window()
    for xb,yb in r.pieces(m, idxs):
        for p in ps: p.grad = None
        pred,loss = r.forward(m, xb, yb)
        n = r.count(xb, yb, pred, loss)
        if not w.n_micro: w.begin(n, loss_reduction(r.learn.loss_func) == 'sum')
        (loss*w.loss_weight(n)).backward()
        w.add(n, find_bs(yb if len(yb) else xb), loss.detach())
        g = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        small.append(float(sq_norm(g))*w.mean_factor(n)**2); inv_b.append(1/n)   # the micro-batch's mean gradient
        # the window's, weighted
        acc = [t.double() for t in g] if acc is None else [a.add_(t.double()) for a,t in zip(acc, g)]
    items = w.items
    g_big2 = float(sq_norm([a*w.mean_factor(items) for a in acc]))
    b = 1/float(np.mean(inv_b))
    g2,tr = noise_estimates(float(np.mean(small)), g_big2, b, items)
    return dict(g_small2=float(np.mean(small)), g_big2=g_big2, b=b, B=items, g2=g2, trace=tr)
