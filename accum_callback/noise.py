"""How big should the batch be? The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", Appendix A), measured from accumulation at almost no cost, and a window that grows with it.

A window already holds the two gradients the estimate needs: that of its first micro-batch (b items, in `.grad` after
the window's first backward) and that of the whole window (B items, before the step). With mean-normalised gradients,
E|g_b|^2 = |G|^2 + tr(S)/b for any b, so from the two sizes:

    |G|^2 ~ (B |g_B|^2 - b |g_b|^2) / (B - b)        tr(S) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

each unbiased; the ratio of their moving averages is B_simple = tr(S)/|G|^2, which predicts the critical batch size.
Two fused norm reductions a window, no extra backward, no copy of the gradients."""
from __future__ import annotations
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from fastai.callback.core import Callback
from fastai.learner import Learner, ValueMetric
from fastai.torch_core import find_bs
from fastcore.basics import patch

from .accumulate import GradientAccumulation
from .batchnorm import BatchNormAccumulation
from .micro import micro_batching, micro_size, n_pieces
from .micro.loader import batch_sizes, loader_pieces, model_device, own_loader
from .compat import foreach, grad_scale, held_unsharded_grad, local_tensor
from .distributed import fsdp_params, is_distributed, is_fsdp
from .guard import add_fit_guard, in_inference, one_per_learner, refuse_at_fit_start, remove_fit_guard
from .losses import loss_reduction
from .window import Window
from .compat import rngs_kept
from .replay import Replay, training_model
from .validate import flag, whole_number

LR_RULES = (None, 'linear', 'sqrt', 'auto')

__all__ = ['GradientNoiseScale', 'NoiseScaleSchedule', 'NoiseScaleReport', 'noise_estimates']

def noise_estimates(g_small2, g_big2, b, B)->tuple:
    """McCandlish's unbiased estimates `(|G|^2, tr(S))` from the squared norms of two mean gradients over `b` and `B > b`
    items (numbers or tensors; `b` may be a mean of 1/b over several small gradients, given as `1/b`'s inverse)"""
    return (B*g_big2 - b*g_small2)/(B - b),(g_small2 - g_big2)/(1/b - 1/B)

def _ratio_of(g2:float, tr:float)->float:
    return math.nan if not tr > 0 else (tr/g2 if g2 > 0 else math.inf)

def _sq_norm(ts:list)->torch.Tensor:
    "Sum of squares of `ts` (one fused norm kernel), in float64, on their device; a DTensor counts its local shard"
    ts = [local_tensor(t) for t in ts if t is not None]
    if not ts: return torch.zeros((), dtype=torch.float64)
    norms = foreach('norm')(ts)
    by = {}
    for n in norms: by.setdefault(n.dtype, []).append(n)   # (one stack per dtype, not a conversion per tensor)
    return sum(torch.stack(ns).double().pow(2).sum() for ns in by.values())

@one_per_learner("(Each would log the same measurements.)")
class GradientNoiseScale(Callback):
    """Measure the gradient noise scale B_simple = tr(S)/|G|^2 at every optimizer step from what accumulation already
    has: the squared norm of the window's first micro-batch gradient and of the whole window's (unscaled from fp16's
    grad scaler; under DDP the micro-batch norm averaged over ranks and the window's global, so every rank agrees).
    Logged per step (`g_small2`, `g_big2`, `b`, `B`, `g2`, `trace`, their moving averages, `b_simple`), as a column of
    the Recorder (`noise_scale`, at each epoch's end) and by `plot_noise_scale()`. `schedule()` grows the window with it.

    A window of one micro-batch has nothing to compare and is not counted. BatchNorm in training couples the samples of
    a micro-batch and dropout adds noise of its own: both bias the estimate (docs/noise_scale.md)."""
    order,run_valid,_only_train_loop = GradientAccumulation.order+1,False,True   # the window's gradient is final (scaled by ours), not yet unscaled

    def __init__(self,
        beta:float=0.98, # moving-average weight of the last estimate is 1-beta (bias-corrected, as Adam's): ~50 windows
    ):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"`beta` must be in [0, 1), got {beta!r}")
        self.beta,self.ga,self.schedules = float(beta),None,[]
        self._reset()

    @property
    def n_measured(self)->int: "Windows measured in this fit"; return self._n

    def _reset(self):
        self.log = dict(g_small2=[], g_big2=[], b=[], B=[], g2=[], trace=[], g2_ema=[], trace_ema=[], step=[])
        self._ema,self._n,self._first,self._steps,self._host = None,0,None,0,None

    # -- results --------------------------------------------------------------------------------------------------
    @property
    def b_simple(self)->float:
        """The latest B_simple (ratio of the moving averages of tr(S) and |G|^2): nan before the first measured window
        or while no noise is measured (tr(S) <= 0), inf while the mean gradient is lost in the noise (|G|^2 <= 0)"""
        if self._ema is None: return math.nan
        if self._host is not None and self._host[0] == self._n: return self._host[1]   # (read back at the last step)
        return _ratio_of(*self._ema.tolist())
    @property
    def b_simple_history(self)->list:
        "B_simple after each measured step"
        return [_ratio_of(g, t) for g,t in zip(self.values('g2_ema'), self.values('trace_ema'))]
    def values(self, k:str)->list:
        "The per-step log `k` as floats (one host synchronisation for the whole log)"
        v = self.log[k]
        return torch.stack([torch.as_tensor(x, dtype=torch.float64).cpu() for x in v]).tolist() if v else []

    def schedule(self, fraction:float=0.5, lo:int|None=None, hi:int|None=None, unit:str='items', warmup:int|None=None,
                 lr:str|None='auto', growth:int|None=8)->NoiseScaleSchedule:
        """A window size that follows the measured noise scale: `GradientAccumulation(target_bs=noise.schedule(...))`:
        `fraction` of B_simple, from `lo` (default: two of the training loader's batches, the smallest window that is
        measured) until `warmup` windows are measured (default: the moving average's span, `1/(1-beta)`), at most `hi`
        (default: `growth` times `lo`), each step's learning rate scaled with its window against `lo` (`lr`: 'auto',
        linear for SGD and the square root for Adam-like optimisers; 'linear', 'sqrt', or None to keep it). The defaults
        are bench/noise_study.py's choice (docs/noise_scale.md): keep your learning-rate decay beside it"""
        if warmup is None: warmup = round(1/(1-self.beta))
        s = NoiseScaleSchedule(self, fraction, lo, hi, unit, warmup, lr, growth)
        self.schedules.append(s)
        return s

    # -- fit ----------------------------------------------------------------------------------------------------
    def before_fit(self):
        if in_inference(self.learn): return
        refuse_at_fit_start(self.learn)   # (ours and the other callbacks of ours: before anything is set up)
        self.ga = next(cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation))
        self._reset()
        self.ga.on_window_close(self._closed)
        # a column of the Recorder for the fit (fastai's ValueMetric: the value at the end of each epoch's validation)
        self._metric = ValueMetric(self._epoch_value, 'noise_scale')
        self.learn.metrics = list(self.learn.metrics) + [self._metric]
        add_fit_guard(self.learn, 'gradient_noise_scale', lambda e: self._unhook())   # a fit ended by an exception

    def refuse_fit(self):
        "What this fit is refused for (`guard.refuse_at_fit_start`): no windows to measure, gradients no rank holds whole"
        ga = next((cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation)), None)
        if ga is None:
            raise ValueError("GradientNoiseScale measures the windows of `accum_callback.GradientAccumulation`, which is not "
                             "in this fit: add `GradientAccumulation(n_step=...)` (two micro-batches a window at least)")
        mb = micro_batching(self.learn)
        bs = getattr(self.dls.train, 'bs', None)
        if mb is None and ga.n_step_sched is not None and ga.n_step_sched.kind == 'const' and ga.n_step_sched.const == 1:
            raise ValueError("GradientNoiseScale compares a window's first micro-batch with the whole window, and "
                             "`GradientAccumulation(n_step=1)` makes windows of one micro-batch: nothing would be measured. "
                             "Give `n_step` >= 2 (or `micro_bs`, whose pieces make a window)")
        for sc in self.schedules:
            if sc.source is self and mb is None and bs and sc.lo is not None and sc.lo*sc.items_per_unit() <= bs:
                raise ValueError(f"GradientNoiseScale.schedule(lo={sc.lo}): a window of at most the loader's batch ({bs} items) "
                                 "is one micro-batch, which is never measured, so the window would never grow: give `lo` "
                                 f"above {bs} items (e.g. lo={2*bs}), or leave it out (two micro-batches)")
        if ga.sharded_grads and is_fsdp(self.model):
            raise ValueError("GradientNoiseScale under FSDP2 with `GradientAccumulation(sharded_grads=True)`: the first "
                             "micro-batch's gradient is reduce-scattered at once, so no rank holds it alone; measure with "
                             "the default `sharded_grads=False`")

    def after_fit(self):
        if in_inference(self.learn) or self.ga is None: return
        self._unhook()

    def _unhook(self):
        "The fit is over, however it ended: the Learner's metrics and the window's listeners as they were"
        if self.ga is not None: self.ga.remove_window_listener(self._closed)
        self.learn.metrics = [m for m in self.learn.metrics if m is not getattr(self, '_metric', None)]
        remove_fit_guard(self.learn, 'gradient_noise_scale')

    def _epoch_value(self)->float: return self.b_simple

    def _closed(self, stepped:bool): self._first = None

    def after_backward(self):
        "The window's first counted micro-batch: the squared norm of its mean gradient (local: nothing synchronised yet)"
        w = self.ga.window
        if not w.is_first or w.closes: return   # (a window of one: nothing to compare)
        grads = ([held_unsharded_grad(fp) for fp in fsdp_params(self.model)] if is_fsdp(self.model)
                 else [p.grad for p in self.model.parameters()])
        n = torch.as_tensor(w.n, dtype=torch.float64)
        k = torch.as_tensor(w.mean_factor(n), dtype=torch.float64).to(model_device(self.model))   # its mean gradient, by the window's rule
        self._first = (_sq_norm(grads)*k.square(), n)

    def before_step(self):
        "The window is final: the squared norm of its mean gradient, the estimates, their moving averages"
        first,w = self._first,self.ga.window
        if first is None or w.record is None: return
        g_small2,b = first
        dev = g_small2.device
        g_big2 = _sq_norm([p.grad for p in self.model.parameters()])
        if is_fsdp(self.model): g_big2 = self._sum_over_ranks(g_big2)   # each rank holds its shard of the global gradient
        items = float(w.record.items)   # the window's items over every rank (GradientAccumulation's one synchronisation)
        # the step's gradient (`step_scale` applied) as the window's mean: a mean loss's already is, a summed loss's is the sum
        g_big2 = g_big2*(w.mean_factor(items)/w.step_scale(items, 1))**2
        if is_distributed(self.model):   # the micro-batch was each rank's own: average the ranks' squared norms and 1/b
            world = dist.get_world_size()
            g_small2,inv_b = (self._sum_over_ranks(torch.stack([g_small2, 1/b.to(dev)]))/world).unbind()
            b = 1/inv_b
        scale = grad_scale(self.learn)   # fp16's grad scaler multiplied every gradient
        if scale is not None: g_small2,g_big2 = g_small2/scale**2,g_big2/scale**2
        b,B = b.to(dev),torch.tensor(items, dtype=torch.float64, device=dev)
        if not bool((B > b).all()): return   # nothing larger to compare with (the window is its first micro-batch)
        g2,tr = noise_estimates(g_small2, g_big2, b, B)
        est = torch.stack([g2, tr])
        ok = torch.isfinite(est).all()   # an overflowing fp16 window is skipped by the scaler: not counted here either
        self._n += 1   # (counted on the host: every rank the same)
        if self._ema is None: self._ema_raw = torch.zeros(2, dtype=torch.float64, device=dev)
        self._ema_raw = torch.where(ok, self.beta*self._ema_raw + (1-self.beta)*est, self._ema_raw)
        self._ema = self._ema_raw/(1 - self.beta**self._n) if self.beta else self._ema_raw
        for k,v in zip(self.log, (g_small2, g_big2, b, B, g2, tr, self._ema[0], self._ema[1], self.ga.steps)): self.log[k].append(v)
        # a schedule reads B_simple at the next window's start: read it back here, in the step's micro-batch (which
        # synchronised for the window's counts already), not in a micro-batch that does not step
        if self.schedules: self._host = (self._n, _ratio_of(*self._ema.tolist()))

    def state_dict(self)->dict:
        "The averages, the logs and each schedule's window size (a checkpoint between micro-batches)"
        return dict(ema_raw=getattr(self, '_ema_raw', None), ema=self._ema, n=self._n, log=self.log, first=self._first,
                    schedules=[(s.value, list(s.history)) for s in self.schedules])
    def load_state_dict(self, sd:dict):
        self._ema_raw,self._ema,self._n,self.log,self._first = sd['ema_raw'],sd['ema'],sd['n'],sd['log'],sd['first']
        self._host = None
        for s,(v,h) in zip(self.schedules, sd['schedules']): s.value,s.history = v,h

    def _sum_over_ranks(self, t:torch.Tensor)->torch.Tensor:
        t = t.clone(); dist.all_reduce(t); return t

    def plot_noise_scale(self, ax=None):
        "B_simple and the effective batch (items per step) against optimizer steps, on a log scale; returns the axes"
        import matplotlib.pyplot as plt
        new = ax is None
        if new: _,ax = plt.subplots(figsize=(6, 3.5))
        steps = self.values('step')
        ax.plot([s+1 for s in steps], self.b_simple_history, label='noise scale $B_{simple}$')
        if self.ga is not None and self.ga.window_sizes:
            ax.plot(range(1, len(self.ga.window_sizes)+1), self.ga.window_sizes, label='effective batch (items per step)')
        ax.set_yscale('log'); ax.set_xlabel('optimizer step'); ax.set_ylabel('items'); ax.legend()
        if new: ax.figure.tight_layout()
        return ax

class NoiseScaleSchedule:
    """A window size from the measured noise scale, for `GradientAccumulation(target_bs=...)` (`unit='items'`) or
    `n_step=...` (`unit='micro_batches'`, the items divided by the loader's batch size, rounded up): `fraction` times
    B_simple, never smaller than the largest it has given (it only grows), within `[lo, hi]`; `lo` until the first
    measurement and until `warmup` windows are measured (a noisy first estimate would otherwise ratchet the window up);
    `hi` left out is `growth` times `lo` (None: no cap); `lr` scales each step's learning rate with its window (`lr_gain`).
    `GradientAccumulation` asks at each window's start, so every step stays the exact mean of its window, and the value
    depends on the measurements alone (under DDP the same on every rank)."""
    def __init__(self, source, fraction:float=1., lo:int|None=None, hi:int|None=None, unit:str='items', warmup:int=0,
                 lr:str|None=None, growth:int|None=None):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (fraction > 0 and math.isfinite(fraction)):
            raise ValueError(f"`fraction` must be a finite number > 0, got {fraction!r}")
        if lo is not None: lo = whole_number(lo, 'lo')
        if hi is not None and lo is not None and whole_number(hi, 'hi') < lo: raise ValueError(f"`hi` ({hi}) must be >= `lo` ({lo})")
        if hi is not None: whole_number(hi, 'hi')
        if unit not in ('items', 'micro_batches'): raise ValueError(f"`unit` must be 'items' or 'micro_batches', got {unit!r}")
        self.warmup = whole_number(warmup, 'warmup', lo=0)
        if lr not in LR_RULES: raise ValueError(f"`lr` must be one of {', '.join(map(repr, LR_RULES))}, got {lr!r}")
        self.lr,self.growth = lr,(None if growth is None else whole_number(growth, 'growth'))
        self.source,self.fraction,self.lo,self.hi,self.unit,self.value = source,float(fraction),lo,hi,unit,lo
        self.history = []   # (optimizer step, value) each time it changed

    def resolve_lo(self, learn=None)->int:
        "`lo` in this schedule's unit; left out: two of the training loader's batches (the smallest window measured)"
        if self.lo is not None: return self.lo
        if self.unit == 'micro_batches': return 2
        learn = learn or getattr(self.source, 'learn', None)
        bs = getattr(getattr(getattr(learn, 'dls', None), 'train', None), 'bs', None) if learn is not None else None
        return 2*int(bs or 1)

    def items_per_unit(self)->int:
        learn = getattr(self.source, 'learn', None)
        bs = getattr(getattr(getattr(learn, 'dls', None), 'train', None), 'bs', None) if learn is not None else None
        return 1 if self.unit == 'items' else max(1, int(bs or 1))

    def resolve_hi(self)->int|None:
        "`hi`, or left out: `growth` times `lo` (None: no cap)"
        if self.hi is not None: return self.hi
        return None if self.growth is None else self.growth*self.resolve_lo()

    def __call__(self, pct:float=0., epoch:int=0)->int:
        lo,hi = self.resolve_lo(),self.resolve_hi()
        if hi is not None: lo = min(lo, hi)
        if self.value is None or self.value < lo:
            if getattr(self.source, 'learn', None) is None: return lo   # (checked before any Learner: `lo` not known yet)
            self.value = lo
        b = self.source.b_simple
        if math.isfinite(b) and getattr(self.source, 'n_measured', math.inf) >= self.warmup:
            v = max(lo, math.ceil(self.fraction*b/self.items_per_unit()))
            if hi is not None: v = min(v, hi)
            if v > self.value:
                self.value = v
                self.history.append((getattr(getattr(self.source, 'ga', None), 'steps', 0), v))
        return self.value

    def lr_gain(self, size:int, opt=None)->float:
        """How much a window of `size` (this schedule's unit: its items, or its micro-batches) multiplies the step's learning rate: 1 with `lr=None`, else
        `size/lo` ('linear') or its square root ('sqrt'; 'auto' picks the square root for an optimizer with a second
        moment, `sqr_mom`, as Adam's, linear otherwise). `GradientAccumulation` applies it to the window's step"""
        if self.lr is None or not size: return 1.
        k = size/max(self.resolve_lo(), 1)   # (`lo` of `unit`, as `size` is)
        rule = self.lr
        if rule == 'auto': rule = 'sqrt' if opt is not None and any('sqr_mom' in h for h in opt.hypers) else 'linear'
        return k if rule == 'linear' else math.sqrt(k)

    def __repr__(self):
        return (f"NoiseScaleSchedule(fraction={self.fraction}, lo={self.lo}, hi={self.hi}, unit={self.unit!r}"
                + (f", lr={self.lr!r}" if self.lr else '') + (f", growth={self.growth}" if self.growth else '') + ")")

# -- learn.noise_scale(): one measurement before training ---------------------------------------------------------------
@dataclass
class NoiseScaleReport:
    """What `learn.noise_scale()` measured at the current weights: `b_simple` (ratio of the mean estimates of tr(S) and
    |G|^2 over `n_windows` windows), `interval` (95%, bootstrap over the windows), `g2` and `trace`, the micro-batch and
    window sizes in items (`b`, `B`), and what to accumulate to for an effective batch of B_simple with this loader:
    `target_bs` and `n_step` (micro-batches of the loader's batch). Where no estimate can be made (the mean gradient lost in
    the noise, no finite window) `target_bs` and `n_step` are None and `reason` says why; `n_skipped`: windows left out
    because a loss or gradient in them was not finite"""
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
        read = f"{self.items_read} items, {self.items_read/self.set_items:.2g} of the training set" if self.set_items else ''
        if self.set_items and self.items_read > self.set_items: read += " (more than it holds: windows repeat samples)"
        suggested = (f"target_bs={self.target_bs} (n_step={self.n_step} micro-batches of the loader's batch)"
                     if self.target_bs is not None else f"nothing: {self.reason}")
        return '\n'.join(['noise_scale', '-'*72,
            (f"B_simple          {self.b_simple:.3g} items (95% {lo:.3g} to {hi:.3g}, {self.n_windows} {self.what}{skipped})"
             if math.isfinite(self.b_simple) else
             f"B_simple          not estimated ({self.n_windows} {self.what}{skipped})" + (f": above {lo:.3g} items at 95%" if lo > 0 else '')),
            f"|G|^2, tr(S)      {self.g2:.3g}, {self.trace:.3g}",
            f"measured with     micro-batches of {self.b:.3g} items " + (f"in windows of {self.B:.3g}" if self.what == 'windows' else 'pooled')
            + (f"; read {read}" if read else ''),
            f"suggested         {suggested}"])
    __repr__ = __str__

def _ratio(g2, tr)->float:
    "tr(S)/|G|^2 of the windows' mean estimates: nan where no noise is measured, inf where the mean gradient is lost in it"
    g,t = float(np.mean(g2)),float(np.mean(tr))
    return _ratio_of(g, t)

@patch
def noise_scale(self:Learner,
    n_windows:int|None=None, # windows to measure (each a training window's compute, no step); None: as many as `max_items` allows, fewer once the interval is narrow
    n_step:int|None=None, # micro-batches a window (default: 8, fewer where `max_items` would hold under 8 windows; at least 2)
    seed:int=0, # which shuffled windows of the training loader
    quiet:bool=True, # BatchNorm normalising with its running statistics and dropout off: only the data's noise is measured
    max_items:int|None=None, # items to read at most with `n_windows=None` (default: a quarter of the training set, at least 4 windows of 2 micro-batches)
    rel_width:float=1.5, # with `n_windows=None`: stop once the 95% interval's high end is within this factor of its low end
)->NoiseScaleReport:
    """Measure the gradient noise scale B_simple at the current weights over windows of the training loader (shuffled,
    with `seed`), on a copy of the model: no step, and the Learner's weights, optimizer, RNG states and BatchNorm
    statistics are left as they were. `quiet` (the default): BatchNorm layers normalise with their running statistics
    (training couples a micro-batch's samples through its statistics, which biases the estimate) and dropout is off (its
    noise is not the data's); `quiet=False` measures the model as it trains. By default it reads at most a quarter of the
    training set (`max_items`) and stops earlier once the 95% interval is narrow (`rel_width`); `n_windows` measures that
    many, and the report says when they read more items than the set holds. Returns the estimate with its interval and
    the `target_bs`/`n_step` that accumulate an effective batch of B_simple, or none, with the reason, where it cannot
    be estimated"""
    ga = next((cb for cb in self.cbs if isinstance(cb, GradientAccumulation)), None)
    if n_windows is not None: n_windows = whole_number(n_windows, 'n_windows', lo=2)
    if max_items is not None: max_items = whole_number(max_items, 'max_items', lo=1)
    if isinstance(rel_width, bool) or not isinstance(rel_width, (int, float)) or not rel_width > 1:
        raise ValueError(f"`rel_width` must be a number > 1 (the interval's high end over its low end), got {rel_width!r}")
    if n_step is not None: n_step = whole_number(n_step, 'n_step', lo=2)
    if is_fsdp(self.model): raise ValueError("noise_scale: the model is sharded with FSDP2; measure before sharding it")
    with rngs_kept():
        size = micro_size(self)
        dl = own_loader(self, shuffle=True, seed=seed)
        per_epoch = sum(n_pieces(n, size) if size else 1 for n in batch_sizes(dl))
        if per_epoch < 1:
            raise ValueError(f"noise_scale: the training loader gives no full batch of {getattr(dl, 'bs', '?')} items "
                             f"(the training set holds {getattr(dl, 'n', '?')}): nothing to measure; use a smaller batch size")
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
            if n_step is None: n_step = max(8, ga.window_n_step if ga is not None else 8)   # B - b large: a steadier |G|^2
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
    """Every micro-batch read, pooled (the default of `learn.noise_scale()`): micro-batch i's summed gradient s_i over n_i
    items has E<s_i, s_l> = n_i n_l |G|^2 for i != l and E|s_i|^2 = n_i^2 |G|^2 + n_i tr(S), so with N = sum n_i,
    Q = sum n_i^2, A = sum |s_i|^2 and T = sum s_i:

        |G|^2 ~ (|T|^2 - A) / (N^2 - Q)        tr(S) ~ (A - Q |G|^2) / N

    (the window estimator's, over one window of everything read: every pair of micro-batches measures the mean gradient).
    The micro-batches are read in groups; the groups' summed gradients (one flat copy each) and their inner products are
    kept, so the bootstrap resamples groups with the pairs inside a group counted once, and a group never pairs with itself"""
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
        return _central95([_ratio_of(*self.estimates(np.bincount(rng.integers(0, g, g), minlength=g).astype(float)))
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
            return NoiseScaleReport(b_simple=math.nan, interval=(math.nan, math.nan), g2=math.nan, trace=math.nan, b=b, B=N,
                                    n_windows=g, target_bs=None, n_step=None, per_window=per, items_read=int(round(N)),
                                    reason="a loss or gradient was not finite")
        rep = _suggest(_ratio_of(g2, tr), self.interval(seed), g2, tr, b, N, g, bs, per, 0, f"{g} groups of {N/g:.3g} items")
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
    "The estimate over the finite windows of `per`, its bootstrap interval, and a suggestion only where one can be defended"
    ok = [p for p in per if math.isfinite(p['g2']) and math.isfinite(p['trace'])]   # (training skips such windows too)
    n_skipped = len(per) - len(ok)
    b = float(np.mean([p['b'] for p in per])) if per else math.nan
    B = float(np.mean([p['B'] for p in per])) if per else math.nan
    if len(ok) < 2:
        return NoiseScaleReport(b_simple=math.nan, interval=(math.nan, math.nan), g2=math.nan, trace=math.nan, b=b, B=B,
                                n_windows=len(ok), target_bs=None, n_step=None, per_window=per, n_skipped=n_skipped,
                                reason=f"{n_skipped} of {len(per)} windows gave a non-finite loss or gradient, fewer than 2 are left")
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
    """One window of the replayed copy, micro-batch by micro-batch as training runs it and by the window's rule (`quiet`:
    BatchNorm on its running statistics, dropout off): the mean of the micro-batches' squared mean-gradient norms, the
    squared norm of the window's mean gradient, and the estimates from them"""
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
        small.append(float(_sq_norm(g))*w.mean_factor(n)**2); inv_b.append(1/n)   # the micro-batch's mean gradient
        acc = [t.double() for t in g] if acc is None else [a.add_(t.double()) for a,t in zip(acc, g)]   # the window's, weighted
    items = w.items
    g_big2 = float(_sq_norm([a*w.mean_factor(items) for a in acc]))
    b = 1/float(np.mean(inv_b))
    g2,tr = noise_estimates(float(np.mean(small)), g_big2, b, items)
    return dict(g_small2=float(np.mean(small)), g_big2=g_big2, b=b, B=items, g2=g2, trace=tr)
