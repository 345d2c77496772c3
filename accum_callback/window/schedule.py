"Window-size schedules: a constant, a `{epoch: value}` mapping, or a fastai-style function of training progress"
from __future__ import annotations
import math
from collections.abc import Mapping
from numbers import Integral

from ..core.args import whole_number   # (re-exported for code that read them from here)

__all__ = ['WindowSchedule', 'as_window_schedule', 'batch_growth_from_lr', 'window_arguments', 'PARTIAL_MODES',
           'decide', 'windows_started', 'WindowClock']

PARTIAL_MODES = ('step', 'drop', 'carry')

def window_arguments(n_step=None, target_bs=None, partial=None):
    """`GradientAccumulation`'s window arguments, checked: `(n_step, target_bs, partial)`, the first two as
    `WindowSchedule`s or None"""
    if n_step is not None and target_bs is not None:
        raise ValueError("Give exactly one of `n_step` (micro-batches per optimizer step) or `target_bs` "
                         f"(items per optimizer step); got n_step={n_step!r}, target_bs={target_bs!r}")
    if partial is None: partial = 'step'
    if not isinstance(partial, str) or partial not in PARTIAL_MODES:
        raise ValueError(f"`partial` must be one of {PARTIAL_MODES}, got {partial!r}")
    return as_window_schedule(n_step, 'n_step'),as_window_schedule(target_bs, 'target_bs'),partial

class WindowSchedule:
    "The window size (micro-batches or items) in force at a point of training: `sched(pct_train, epoch) -> int`"
    def __init__(self, value, name:str):
        self.name,self.value = name,value
        if isinstance(value, Mapping):
            if not value: raise ValueError(f"`{name}` mapping is empty: give at least {{0: value}}")
            for k in value:
                if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
                    raise TypeError(f"`{name}` mapping keys must be epochs (whole numbers >= 0), got {k!r}")
            if 0 not in value:
                raise ValueError(f"`{name}` mapping must give the value for epoch 0, got keys {sorted(value)}")
            self.table = sorted((int(k), whole_number(v, name, f' (value for epoch {k})')) for k,v in value.items())
            self.kind = 'epochs'
        elif callable(value):
            self.kind,self.fn = 'fn',value
            for i in range(101): self._from_fn(i/100)  # validate over the whole of training, at construction
        else:
            self.const,self.kind = whole_number(value, name),'const'

    def _from_fn(self, pct:float)->int:
        try: v = float(self.fn(pct))
        except Exception as e: raise ValueError(f"`{self.name}` schedule failed at pct={pct:.2f}: {e}") from e
        if not math.isfinite(v): raise ValueError(f"`{self.name}` schedule gave {v} at pct={pct:.2f}")
        r = int(round(v))
        if r < 1:
            raise ValueError(f"`{self.name}` schedule gave {v} at pct={pct:.2f}, which rounds to {r}: values must "
                             "round to >= 1")
        return r

    def __call__(self, pct:float=0., epoch:int=0)->int:
        if self.kind == 'const': return self.const
        if self.kind == 'fn': return self._from_fn(min(max(pct, 0.), 1.))
        return [v for k,v in self.table if k <= epoch][-1]

    @property
    def constant(self)->int|None:
        "The window's size where it never changes, else None"; return self.const if self.kind == 'const' else None
    @property
    def per_epoch(self)->bool:
        "Is the size known for a whole epoch ahead (a number or an `{epoch: n}` mapping), not only as training goes?"
        return self.kind != 'fn'
    def lr_gain(self, size:int, opt=None)->float:
        """How much a window of `size` (the schedule's unit: micro-batches for `n_step`, items for `target_bs`)
        multiplies its step's learning rate: 1 here; a schedule that scales the rate with the window says otherwise
        (`noise.NoiseScaleSchedule(lr=...)`)"""
        return 1.

    def __repr__(self): return f"WindowSchedule({self.name}={self.value!r})"

def as_window_schedule(value, name:str)->WindowSchedule|None:
    """`None` stays `None`, a `WindowSchedule` (a subclass's too) is taken as it is; anything else becomes a validated
    one"""
    if isinstance(value, WindowSchedule): value.name = name; return value
    return None if value is None else WindowSchedule(value, name)

def batch_growth_from_lr(lr_sched, base:int, max_value:int|None=None, name:str='n_step'):
    """Turn a learning-rate decay schedule into the equivalent batch-growth schedule (Smith et al., ICLR 2018):
    where the learning rate would have fallen by a factor f, the window grows by f instead, capped at `max_value`.

    `lr_sched` is a fastai-style function of training progress (`SchedExp(1e-2, 1e-3)`, `combine_scheds(...)`)
    or an `{epoch: lr}` mapping; `base` is the window at the start. Returns a value for `n_step`/`target_bs`:
    a function of progress, or an `{epoch: window}` mapping when given a mapping.

    >>> batch_growth_from_lr({0: 0.1, 3: 0.01}, base=2, max_value=16)
    {0: 2, 3: 16}
    """
    base = whole_number(base, 'base')
    if max_value is not None: max_value = whole_number(max_value, 'max_value')
    cap = (lambda v: v) if max_value is None else (lambda v: min(v, max_value))
    if isinstance(lr_sched, Mapping):
        if 0 not in lr_sched: raise ValueError("`lr_sched` mapping must give the learning rate for epoch 0")
        lr0 = float(lr_sched[0])
        for k,lr in lr_sched.items():
            if not (float(lr) > 0): raise ValueError(f"`lr_sched` must be > 0 everywhere, got {lr} at epoch {k}")
        return {int(k): cap(max(1, int(round(base*lr0/float(lr))))) for k,lr in sorted(lr_sched.items())}
    if not callable(lr_sched):
        raise TypeError(f"`lr_sched` must be a function of progress or an {{epoch: lr}} mapping, got {lr_sched!r}")
    lr0 = float(lr_sched(0.))
    for i in range(101):
        if not (float(lr_sched(i/100)) > 0):
            raise ValueError(f"`lr_sched` must be > 0 everywhere, got {lr_sched(i/100)} at pct={i/100:.2f}")
    def _grow(pct): return cap(max(1, int(round(base*lr0/float(lr_sched(pct))))))
    _grow.__doc__ = f"{name} grown as the learning rate would have decayed, from {base}" + (f", capped at {max_value}"
                                                                                            if max_value else "")
    return _grow

def decide(b:int, units:int, seen:int, target:int, by_items:bool, last:bool, partial:str, last_epoch:bool)->str|None:
    """The window rule for a unit of `b` items (a micro-batch, or a loader batch cut into micro-batches) after `units`
    units and `seen` items of the window: 'step', 'drop' or None (the window stays open). It closes at the unit reaching
    `target` (units, or items when `by_items`); at the loader's `last` unit a partial window is stepped, dropped, or
    carried into the next epoch (`partial`), never past the fit (`last_epoch`)"""
    if (seen+b >= target) if by_items else (units+1 >= target): return 'step'
    if not last: return None
    if partial == 'step': return 'step'
    if partial == 'drop' or last_epoch: return 'drop'
    return None

def windows_started(sizes:list, target:int, by_items:bool, partial:str, last_epoch:bool, units:int=0, seen:int=0)->int:
    """How many of the windows that start in an epoch of units of `sizes` items step (`decide`'s rule; `units`/`seen`:
    a window carried in from the epoch before, which started there); a window carried on counts where it starts"""
    n,here = 0,False
    for i,b in enumerate(sizes):
        if units == 0: n,here = n+1,True
        a = decide(b, units, seen, target, by_items, i == len(sizes)-1, partial, last_epoch)
        if a is None: units,seen = units+1,seen+b
        else: n,units,seen = n - (a == 'drop' and here),0,0
    return n

class WindowClock:
    """fastai's schedules read `pct_train`; under accumulation window j of the W that step in an epoch stands for the
    large batch's step j of W, so its step uses the hyper-parameters of `pct_train = (epoch + j/W)/n_epoch`. W is known
    for the whole epoch where the window size is (a number, or an `{epoch: n}` mapping); for a size that follows
    progress (a function, the noise scale) it is not, and the clock is fastai's, by micro-batch (docs/fastai.md)"""
    def __init__(self): self.epoch,self.n_epoch,self.W,self.j = None,1,None,0
    def start_epoch(self, epoch:int, n_epoch:int, sizes:list, sched:WindowSchedule, by_items:bool, partial:str,
                    units:int=0, seen:int=0):
        "An epoch of units of `sizes` items starts (`units`/`seen`: a window carried in from the epoch before)"
        self.epoch,self.n_epoch,self.j = epoch,n_epoch,0
        self.W = None if not sched.per_epoch else (windows_started(sizes, sched(0., epoch), by_items, partial,
                                                                  epoch >= n_epoch-1, units, seen) or None)
    def window_starts(self)->float|None:
        "A window starts: the `pct_train` of the large batch's step it stands for (None: fastai's clock goes on)"
        if self.W is None: return None
        pct = (self.epoch + min(self.j, self.W)/self.W)/self.n_epoch
        self.j += 1
        return pct
