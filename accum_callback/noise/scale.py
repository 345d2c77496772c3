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

import torch
import torch.distributed as dist
from fastai.callback.core import Callback
from fastai.learner import ValueMetric

from ..window.accumulate import GradientAccumulation
from ..micro import micro_batching
from ..core.loaders import model_device
from ..compat.torch import foreach, grad_scale, held_unsharded_grad, local_tensor
from ..core.distributed import fsdp_params, is_distributed, is_fsdp
from ..window.schedule import WindowSchedule
from ..core.protocols import (SaysPickled, add_fit_guard, in_inference, one_per_learner, refuse_at_fit_start,
                              remove_fit_guard)
from ..core.args import whole_number

LR_RULES = (None, 'linear', 'sqrt', 'auto')

__all__ = ['GradientNoiseScale', 'NoiseScaleSchedule', 'noise_estimates']

def noise_estimates(g_small2, g_big2, b, B)->tuple:
    """McCandlish's unbiased estimates `(|G|^2, tr(S))` from the squared norms of two mean gradients over `b` and `B >
    b` items (numbers or tensors; `b` may be a mean of 1/b over several small gradients, given as `1/b`'s inverse)"""
    return (B*g_big2 - b*g_small2)/(B - b),(g_small2 - g_big2)/(1/b - 1/B)

def ratio_of(g2:float, tr:float)->float:
    "B_simple = tr/|G|^2 from the two estimates: NaN where the trace is not positive, inf where |G|^2 is not"
    return math.nan if not tr > 0 else (tr/g2 if g2 > 0 else math.inf)

def sq_norm(ts:list)->torch.Tensor:
    "Sum of squares of `ts` (one fused norm kernel), in float64, on their device; a DTensor counts its local shard"
    ts = [local_tensor(t) for t in ts if t is not None]
    if not ts: return torch.zeros((), dtype=torch.float64)
    norms = foreach('norm')(ts)
    by = {}
    for n in norms: by.setdefault(n.dtype, []).append(n)   # (one stack per dtype, not a conversion per tensor)
    return sum(torch.stack(ns).double().pow(2).sum() for ns in by.values())

@one_per_learner("(Each would log the same measurements.)")
class GradientNoiseScale(SaysPickled, Callback):
    """Measure the gradient noise scale B_simple = tr(S)/|G|^2 at every optimizer step from what accumulation already
    has: the squared norm of the window's first micro-batch gradient and of the whole window's (unscaled from fp16's
    grad scaler; under DDP the micro-batch norm averaged over ranks, or with `global_window` rank 0's, which is one
    process's first micro-batch, so that the estimates are the same on any number of processes; the window's global).
    Logged per step (`g_small2`, `g_big2`, `b`, `B`, `g2`, `trace`, their moving averages, `b_simple`), as a column of
    the Recorder (`noise_scale`, at each epoch's end) and by `plot_noise_scale()`. `schedule()` grows the window with
    it.

    A window of one micro-batch has nothing to compare and is not counted. BatchNorm in training couples the samples of
    a micro-batch and dropout adds noise of its own: both bias the estimate (docs/noise_scale.md)."""
    # the window's gradient is final (scaled by ours), not yet unscaled
    order,run_valid,_only_train_loop = GradientAccumulation.order+1,False,True

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
        return ratio_of(*self._ema.tolist())
    @property
    def b_simple_history(self)->list:
        "B_simple after each measured step"
        return [ratio_of(g, t) for g,t in zip(self.values('g2_ema'), self.values('trace_ema'))]
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
        """What this fit is refused for (`protocols.refuse_at_fit_start`): no windows to measure, gradients no rank
        holds whole"""
        ga = next((cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation)), None)
        if ga is None:
            raise ValueError("GradientNoiseScale measures the windows of `accum_callback.GradientAccumulation`, which "
                             "is not in this fit: add `GradientAccumulation(n_step=...)` (two micro-batches a window "
                             "at least)")
        mb = micro_batching(self.learn)
        bs = getattr(self.dls.train, 'bs', None)
        if mb is None and ga.one_micro_windows:
            raise ValueError("GradientNoiseScale compares a window's first micro-batch with the whole window, and "
                             "`GradientAccumulation(n_step=1)` makes windows of one micro-batch: nothing would be "
                             "measured. Give `n_step` >= 2 (or a `MicroBatching`, whose pieces make a window)")
        for sc in self.schedules:
            if sc.source is self and mb is None and bs and sc.lo is not None and sc.lo*sc.items_per_unit() <= bs:
                raise ValueError(f"GradientNoiseScale.schedule(lo={sc.lo}): a window of at most the loader's batch "
                                 f"({bs} items) is one micro-batch, which is never measured, so the window would never "
                                 f"grow: give `lo` above {bs} items (e.g. lo={2*bs}), or leave it out (two "
                                 "micro-batches)")
        if ga.sync.options_for(self.learn).sharded_grads and is_fsdp(self.model):
            raise ValueError("GradientNoiseScale under FSDP2 with `sharded_grads=True`: the first "
                             "micro-batch's gradient is reduce-scattered at once, so no rank holds it alone; measure "
                             "with the default `sharded_grads=False`")

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
        """The window's first counted micro-batch: the squared norm of its mean gradient (local: nothing synchronised
        yet)"""
        w = self.ga.window
        if not w.is_first or w.closes: return   # (a window of one: nothing to compare)
        grads = ([held_unsharded_grad(fp) for fp in fsdp_params(self.model)] if is_fsdp(self.model)
                 else [p.grad for p in self.model.parameters()])
        n = torch.as_tensor(w.n, dtype=torch.float64)
        # its mean gradient, by the window's rule
        k = torch.as_tensor(w.mean_factor(n), dtype=torch.float64).to(model_device(self.model))
        self._first = (sq_norm(grads)*k.square(), n)

    def before_step(self):
        "The window is final: the squared norm of its mean gradient, the estimates, their moving averages"
        first,w = self._first,self.ga.window
        if first is None or w.record is None: return
        g_small2,b = first
        dev = g_small2.device
        g_big2 = sq_norm([p.grad for p in self.model.parameters()])
        # each rank holds its shard of the global gradient
        if is_fsdp(self.model): g_big2 = self._sum_over_ranks(g_big2)
        # the window's items over every rank (GradientAccumulation's one synchronisation)
        items = float(w.record.items)
        # the step's gradient (`step_scale` applied) as the window's mean: a mean loss's already is, a summed loss's
        # is the sum
        g_big2 = g_big2*(w.mean_factor(items)/w.step_scale(items, 1))**2
        if is_distributed(self.model):
            mine = torch.stack([g_small2, 1/b.to(dev)])
            if self.ga.window_over_ranks:   # rank 0's first micro-batch is one process's (each window's first samples):
                # the same estimates on any number (another rank's first may be padding: 1/b infinite)
                g_small2,inv_b = self._sum_over_ranks(mine if dist.get_rank() == 0 else torch.zeros_like(mine)).unbind()
            else:   # each rank's own micro-batch: average the ranks' squared norms and 1/b
                g_small2,inv_b = (self._sum_over_ranks(mine)/dist.get_world_size()).unbind()
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
        for k,v in zip(self.log, (g_small2, g_big2, b, B, g2, tr, self._ema[0], self._ema[1], self.ga.steps)):
            self.log[k].append(v)
        # a schedule reads B_simple at the next window's start: read it back here, in the step's micro-batch (which
        # synchronised for the window's counts already), not in a micro-batch that does not step
        if self.schedules: self._host = (self._n, ratio_of(*self._ema.tolist()))

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
            ax.plot(range(1, len(self.ga.window_sizes)+1), self.ga.window_sizes,
                    label='effective batch (items per step)')
        ax.set_yscale('log'); ax.set_xlabel('optimizer step'); ax.set_ylabel('items'); ax.legend()
        if new: ax.figure.tight_layout()
        return ax

class NoiseScaleSchedule(WindowSchedule):
    """A window size from the measured noise scale, for `GradientAccumulation(target_bs=...)` (`unit='items'`) or
    `n_step=...` (`unit='micro_batches'`, the items divided by the loader's batch size, rounded up): `fraction` times
    B_simple, never smaller than the largest it has given (it only grows), within `[lo, hi]`; `lo` until the first
    measurement and until `warmup` windows are measured (a noisy first estimate would otherwise ratchet the window up);
    `hi` left out is `growth` times `lo` (None: no cap); `lr` scales each step's learning rate with its window
    (`lr_gain`). `GradientAccumulation` asks at each window's start, so every step stays the exact mean of its window,
    and the value depends on the measurements alone (under DDP the same on every rank)."""
    def __init__(self, source, fraction:float=1., lo:int|None=None, hi:int|None=None, unit:str='items', warmup:int=0,
                 lr:str|None=None, growth:int|None=None):
        if isinstance(fraction,
                      bool) or not isinstance(fraction, (int, float)) or not (fraction > 0 and math.isfinite(fraction)):
            raise ValueError(f"`fraction` must be a finite number > 0, got {fraction!r}")
        if lo is not None: lo = whole_number(lo, 'lo')
        if hi is not None and lo is not None and whole_number(hi, 'hi') < lo:
            raise ValueError(f"`hi` ({hi}) must be >= `lo` ({lo})")
        if hi is not None: whole_number(hi, 'hi')
        if unit not in ('items', 'micro_batches'):
            raise ValueError(f"`unit` must be 'items' or 'micro_batches', got {unit!r}")
        self.warmup = whole_number(warmup, 'warmup', lo=0)
        if lr not in LR_RULES: raise ValueError(f"`lr` must be one of {', '.join(map(repr, LR_RULES))}, got {lr!r}")
        self.lr,self.growth = lr,(None if growth is None else whole_number(growth, 'growth'))
        self.source,self.fraction,self.lo,self.hi,self.unit,self.value = source,float(fraction),lo,hi,unit,lo
        self.history = []   # (optimizer step, value) each time it changed
        # (a `WindowSchedule` known only as training goes)
        self.kind,self.name = 'fn',('target_bs' if unit == 'items' else 'n_step')

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
            # (checked before any Learner: `lo` not known yet)
            if getattr(self.source, 'learn', None) is None: return lo
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
        """How much a window of `size` (this schedule's unit: its items, or its micro-batches) multiplies the step's
        learning rate: 1 with `lr=None`, else `size/lo` ('linear') or its square root ('sqrt'; 'auto' picks the square
        root for an optimizer with a second moment, `sqr_mom`, as Adam's, linear otherwise). `GradientAccumulation`
        applies it to the window's step"""
        if self.lr is None or not size: return 1.
        k = size/max(self.resolve_lo(), 1)   # (`lo` of `unit`, as `size` is)
        rule = self.lr
        if rule == 'auto': rule = 'sqrt' if opt is not None and any('sqr_mom' in h for h in opt.hypers) else 'linear'
        return k if rule == 'linear' else math.sqrt(k)

    def __repr__(self):
        return (f"NoiseScaleSchedule(fraction={self.fraction}, lo={self.lo}, hi={self.hi}, unit={self.unit!r}"
                + (f", lr={self.lr!r}" if self.lr else '') + (f", growth={self.growth}" if self.growth else '') + ")")
