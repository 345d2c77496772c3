"""When `Checkpoint` saves: its one `every`, in composer's spelling (`'<n><unit>'`: `'1ep'`, `'3ba'`, `'30min'`,
`'100st'`; an int n: n optimizer steps; a tuple of these: each), and the state that says "is it time?" (the clock and
the steps at the last checkpoint). No torch: what the fit is comes in as numbers."""
from __future__ import annotations
import math, re, time
from numbers import Integral

__all__ = ['Cadence', 'FORMS', 'MOVED']

FORMS = ("an int n (optimizer steps), '<n>ep' (epochs' ends), '<n>ba' (loader batches, mid-window ones included), "
         "'<n>min' (minutes), '<n>st' or '<n>step' (optimizer steps; 'step': each one), a tuple of these (e.g. "
         "('1ep', '30min')), or None (only on the signals)")

# the keywords before 0.3, each with its spelling in `every` (a TypeError says it: python's own names no new spelling)
MOVED = {'minutes': lambda v: f"`minutes={v!r}` is `every='{v}min'` since 0.3 (with the epoch ends it also saved: "
                              f"every=('1ep', '{v}min'))",
         'batches': lambda v: f"`batches={v!r}` is `every='{v}ba'` since 0.3 (with the epoch ends it also saved: "
                              f"every=('1ep', '{v}ba'))",
         'epoch_end': lambda v: (f"`epoch_end={v!r}` is `every='1ep'` since 0.3 (with others: every=('1ep', '30min'))"
                                 if v else
                                 f"`epoch_end={v!r}` is an `every` without '1ep' since 0.3 (e.g. every='30min'; None: "
                                 "only on the signals)")}

_ONE = re.compile(r'\s*(\d+(?:\.\d*)?|\.\d+)?(?:e([-+]?\d+))?\s*(ep|ba|min|step|st)\s*', re.IGNORECASE)
_FIELD = {'ep': 'epochs', 'ba': 'batches', 'min': 'minutes', 'st': 'steps', 'step': 'steps'}

def _refuse(every, why:str=''): raise ValueError(f"`every` must be {FORMS}; got {every!r}{why}")

def _one(v, every)->tuple[str,float]:
    "`v`, one value of `every`: `(field, n)`"
    if isinstance(v, bool): _refuse(every)
    if isinstance(v, Integral): return ('steps', int(v)) if v >= 1 else _refuse(every, ' (a count is >= 1)')
    if not isinstance(v, str) or (m := _ONE.fullmatch(v)) is None: _refuse(every)
    num,exp,unit = m.groups()
    if num is None and (exp is not None or unit.lower() != 'step'):
        _refuse(every, " (a number before the unit: only 'step' stands alone)")
    n,field = float((num or '1') + (f'e{exp}' if exp else '')),_FIELD[unit.lower()]
    if not (math.isfinite(n) and n > 0): _refuse(every, ' (a finite number > 0)')
    if field != 'minutes':
        if n != int(n): _refuse(every, f" ({unit} counts in whole numbers)")
        n = int(n)
    return field,n

class Cadence:
    """`every` read once (each unit at most once: `epochs`, `batches`, `minutes`, `steps`, None where not asked), and
    the clock and the optimizer steps of the last checkpoint; `Checkpoint` asks at its events whether one is due"""
    def __init__(self, every='1ep'):
        self.every,self.epochs,self.batches,self.minutes,self.steps = every,None,None,None,None
        vals = () if every is None else tuple(every) if isinstance(every, (tuple, list)) else (every,)
        for v in vals:
            field,n = _one(v, every)
            if getattr(self, field) is not None: _refuse(every, f" ({field} named twice)")
            setattr(self, field, n)
        self.start()

    def start(self, steps:int=0):
        "A fit starts (or resumes at `steps`): the clock and the steps count from here"
        self.t0,self.last_steps = time.monotonic(),steps
    def saved(self, steps:int): "A checkpoint was taken after `steps` optimizer steps"; self.start(steps)

    def counted(self, steps:int, k:int)->bool:
        "Due by the counts: `steps` optimizer steps since the last checkpoint, or the epoch's `k`th loader batch"
        return (self.steps is not None and steps - self.last_steps >= self.steps) or self.batch_due(k)
    def batch_due(self, k:int)->bool:
        "The `k`th loader batch of the epoch ends a count of `batches` (saved mid-window)"
        return self.batches is not None and k % self.batches == 0
    def timed(self)->bool:
        "The minutes have passed since the last checkpoint (or the fit's start)"
        return self.minutes is not None and time.monotonic() - self.t0 >= 60*self.minutes
    def epoch_due(self, epoch:int)->bool:
        "The end of epoch `epoch` (from 0) ends a count of `epochs`"
        return self.epochs is not None and (epoch + 1) % self.epochs == 0

    def __repr__(self): return f"Cadence({self.every!r})"
