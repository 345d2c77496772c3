"""The accumulation window: the one owner of the accumulation rule, and the record of the window in progress.

The rule, in three methods every user of it calls (`GradientAccumulation` in training, the check's and the noise scale's
replays of it, `GradientNoiseScale`): a micro-batch's backward loss is its mean loss times `loss_weight(n)` (its `n`
items over the window's reference: the size of one mean-reduced loss is kept); the finished window's summed gradient
times `step_scale(items, world)` is the mean gradient of all its items (DDP's average over ranks undone where needed);
`mean_factor(n)` turns the gradient a weighted backward left for `n` items into their mean gradient. A loss that sums
over its items (`reduction='sum'`) is left alone: the window's gradient is the sum of its micro-batches' sums.

>>> w = Window(); w.begin(3, summed=False)          # micro-batches of 3 and 1 items: the reference is 3
>>> [w.loss_weight(n) for n in (3, 1)]             # each mean loss weighed by its count over the reference
[1.0, 0.3333333333333333]
>>> w.step_scale(items=4)                          # the summed gradient times 3/4: the mean over the 4 items
0.75
>>> w.step_scale(items=8, world=2)                 # DDP averaged 2 ranks' gradients: 8 items over both
0.75

A micro-batch's phase (`Phase`), set by `GradientAccumulation`'s events:

| phase     | entered at                                       | means                                                    |
|-----------|--------------------------------------------------|----------------------------------------------------------|
| IDLE      | the window's creation, `end_micro` (after_batch)  | no micro-batch in progress                               |
| RUNNING   | `start_micro` (before_batch)                      | forward, loss, backward; `n` set once its backward counts |
| STEPPING  | `stepping` (before_step of the closing one)       | the window's gradient is scaled; `record` holds the step |
| CANCELLED | `step_cancelled` (after_cancel_step)              | a callback cancelled this micro-batch's step             |
| CLOSED    | `close` (the window stepped, was dropped/skipped) | only bookkeeping is left for this micro-batch            |

`action`, decided at the micro-batch's start, is what it does to the window: 'step' or 'drop' it (the micro-batch
closes it) or None (the window stays open)."""   # noqa: E501 (the phase table's rows)
from __future__ import annotations
import enum, math
from typing import NamedTuple

import torch

from ..compat.torch import foreach
from ..core.distributed import exit_no_sync

__all__ = ['Window', 'Phase', 'StepRecord']

class Phase(enum.Enum):
    "Where the micro-batch in progress is (see the module's table)"
    IDLE = 'idle'; RUNNING = 'running'; STEPPING = 'stepping'; CANCELLED = 'cancelled'; CLOSED = 'closed'

class StepRecord(NamedTuple):
    """One optimizer step's window: `samples`, `items` (every rank's), its item-weighted mean `loss`, `micro`
    micro-batches"""
    samples: int
    items: float
    loss: float
    micro: int

_NUM = (int, float, torch.Tensor)
_NONE = type(None)

def _fits(v, kinds)->bool:
    "Is `v` of one of `kinds` (a whole number not a bool, and not negative, where `int` alone is asked)?"
    if kinds is int: return type(v) is int and v >= 0
    return isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)

class Window:
    """The accumulation window in progress (`learn.gradient_accumulation.window`) and the accumulation rule.

    Read by other callbacks through its properties: `n_micro` micro-batches counted, `n_samples`, `items` (the counts'
    sum), `target` (its size), `summed`, `is_open`; of the micro-batch in progress: `phase`, `action`, `closes`, `n`
    (its items once its backward counts, else None), `counted`, `is_first` (the window's first counted micro-batch),
    `record` (the step's `StepRecord`, from `before_step` on). Its writes skip fastai's `Callback.__setattr__` checks
    (several per micro-batch)."""
    __slots__ = ('n_micro', 'n_samples', 'items', 'loss_sum', 'ref', 'hypers', 'target', 'n_units', 'unit_action',
                 'summed', 'bs', 'action', 'phase', 'n', 'pending', 'record', 'hypers_now', 'no_sync')
    # what undoing a micro-batch puts back (`snapshot`/`restore`): all but the loader-batch bookkeeping of `micro_bs`
    _UNDO = ('n_micro', 'n_samples', 'items', 'loss_sum', 'ref', 'hypers', 'summed', 'bs', 'action', 'phase', 'n',
             'pending', 'record', 'hypers_now', 'no_sync')

    def __init__(self): self.hypers_now = self.no_sync = None; self.reset(); self.start_micro(); self.phase = Phase.IDLE

    def state_dict(self)->dict:
        """The window in progress, for a checkpoint between micro-batches (not its open no-sync context or swapped
        hyper-parameters), in plain types: the phase as its value, the step's record as a list"""
        sd = {k: getattr(self, k) for k in self.__slots__ if k not in ('no_sync', 'hypers_now')}
        return dict(sd, phase=self.phase.value, record=None if self.record is None else list(self.record))
    def load_state_dict(self, sd:dict):
        "`ValueError` naming the first field that is missing, unknown or not of its type (nothing is set then)"
        sd = dict(sd)
        if isinstance(sd.get('phase'), str) and sd['phase'] in {p.value for p in Phase}:
            sd['phase'] = Phase(sd['phase'])
        if type(sd.get('record')) in (list, tuple) and len(sd['record']) == len(StepRecord._fields):
            sd['record'] = StepRecord(*sd['record'])
        bad = next((k for k in sorted(set(sd) | set(_FIELDS)) if k not in _FIELDS or k not in sd
                    or not _fits(sd[k], _FIELDS[k])), None)
        if bad is not None:
            raise ValueError(f"a window's state holds {bad!r} = {sd.get(bad)!r:.80}: not a window this package wrote")
        for k,v in sd.items(): setattr(self, k, v)

    def reset(self):
        "Forget the window (what its micro-batches left in the gradients is the caller's to step or zero)"
        self.n_micro,self.n_samples,self.items,self.loss_sum,self.ref,self.hypers,self.target = 0,0,0.,0.,None,None,None
        # with `micro_bs`: loader batches in the window, and the last one's decision
        self.n_units,self.unit_action = 0,None
        self.summed = False

    # -- the rule ---------------------------------------------------------------------------------------------------
    @staticmethod
    def reference(n, shared:int|None=None):
        """The window's loss-scale reference: its first micro-batch's count (at least 1), or `shared` where every rank
        needs the same constant (DDP: the loader's batch size)"""
        if shared is not None: return float(shared)
        return n.clamp(min=1.) if isinstance(n, torch.Tensor) else max(n, 1)

    def begin(self, n, summed:bool, shared:int|None=None, hypers=None):
        """The window's first counted micro-batch (of `n` items) sets the reference, the loss's kind and the step's
        hyper-parameters"""
        self.ref,self.summed,self.hypers = self.reference(n, shared),bool(summed),hypers

    def loss_weight(self, n):
        "What the micro-batch's loss (a mean over `n` items, or a sum) is multiplied by before its backward"
        return 1. if self.summed else n/self.ref

    def step_scale(self, items, world:int=1)->float:
        """What the window's gradient (`items` over every rank; averaged over `world` ranks by DDP) is multiplied by
        before the step"""
        return float(world) if self.summed else float(self.ref)*world/items

    def mean_factor(self, n):
        """What turns the gradient that weighted backwards left for `n` items (before `step_scale`) into their mean
        gradient"""
        return 1./n if self.summed else self.ref/n

    def add(self, n, bs:int, loss:torch.Tensor):
        "A micro-batch of `bs` samples and `n` items counts: its mean (or summed) loss `loss` joins the window's"
        self.n_micro += 1; self.n_samples += bs; self.items = self.items + n; self.n,self.pending = n,None
        # a micro-batch of zero items (all ignore_index, all padding) contributes zero, also when its mean loss is NaN
        if self.summed: self.loss_sum = self.loss_sum + loss
        elif isinstance(n, torch.Tensor):
            self.loss_sum = self.loss_sum + torch.where(n > 0, loss*n, torch.zeros_like(loss))
        elif n > 0: self.loss_sum = self.loss_sum + loss*n

    def verdict(self, items, loss_sum, skip_nonfinite:bool=True)->str:
        """What the closing window does, from every rank's `items` and item-weighted `loss_sum`: 'drop' (its unit's
        action), 'skip' (no item, or a non-finite loss where `skip_nonfinite`), or 'step'. With `skip_nonfinite=False` a
        non-finite loss steps (the user asked for it); a window of no item never does

        >>> w = Window(); w.action = 'step'
        >>> (w.verdict(8, 3.5), w.verdict(0, 0.), w.verdict(8, float('nan')),
        ...  w.verdict(8, float('nan'), skip_nonfinite=False))
        ('step', 'skip', 'skip', 'step')
        """
        if self.action == 'drop': return 'drop'
        bad = not (items > 0 and math.isfinite(loss_sum))
        return 'skip' if bad and (skip_nonfinite or items <= 0) else 'step'

    def scale_grads(self, grads:list, items, world:int=1):
        """The window's gradients `grads` (`items` over every rank, averaged over `world` ranks by DDP) scaled in place
        to the large batch's (`step_scale`)"""
        scale = self.step_scale(items, world)
        if grads and scale != 1.: foreach('mul_')(grads, scale)

    # -- the micro-batch in progress
    # ------------------------------------------------------------------------------------
    def start_micro(self, bs:int=0, action=None):
        self.bs,self.action,self.phase,self.n,self.pending,self.record = bs,action,Phase.RUNNING,None,None,None
    def stepping(self, items, loss_sum):
        "The closing micro-batch's window is scaled and about to step: its record"
        self.record,self.phase = StepRecord(self.n_samples, items, loss_sum/items, self.n_micro),Phase.STEPPING
    def step_cancelled(self): self.phase = Phase.CANCELLED
    def close(self): "The window closed in this micro-batch"; self.phase = Phase.CLOSED; self.reset()
    def end_micro(self): self.action,self.phase = None,Phase.IDLE

    @property
    def is_open(self)->bool: "Has a micro-batch been counted since the last step?"; return self.n_micro > 0
    @property
    def counted(self)->bool: "Did the micro-batch in progress's backward run and count?"; return self.n is not None
    @property
    def counts(self)->bool:
        """Will the micro-batch in progress count (its backward under way or done, not cancelled)? Read before its
        `after_backward`"""
        return self.pending is not None or self.n is not None
    @property
    def is_first(self)->bool:
        "Is the micro-batch in progress the window's first counted one?"
        return self.n is not None and self.n_micro == 1
    @property
    def closes(self)->bool:
        "Does the micro-batch in progress close the window (step or drop)?"; return self.action is not None
    @property
    def closed(self)->bool: return self.phase is Phase.CLOSED
    @property
    def stepped(self)->bool:
        "Did this micro-batch's window reach its step, uncancelled?"; return self.phase is Phase.STEPPING

    # -- hyper-parameters and DDP's no_sync, held for the window
    # ------------------------------------------------------------
    def use_hypers(self, opt):
        "The step uses the window's first hyper-parameters; the ones in force now are kept to be put back after it"
        if not self.hypers: return
        now = [dict(h) for h in opt.hypers]
        keys = [k for k in self.hypers[0] if [h.get(k) for h in self.hypers] != [h.get(k) for h in now]]
        if not keys: return
        self.hypers_now = (now, keys)
        for k in keys: opt.set_hyper(k, [h.get(k) for h in self.hypers])
    def put_back_hypers(self, opt):
        "After the step: the values a schedule or another callback set (e.g. ReduceLROnPlateau) are in force again"
        if self.hypers_now is None: return
        (now,keys),self.hypers_now = self.hypers_now,None
        for k in keys: opt.set_hyper(k, [h.get(k) for h in now])
    def exit_no_sync(self):
        if self.no_sync is not None: ctx,self.no_sync = self.no_sync,None; exit_no_sync(ctx)

    # -- undo (MicroBatching's retry after an out-of-memory error)
    # ------------------------------------------------------
    def snapshot(self)->dict:
        "What undoing the micro-batch in progress puts back"; return {k: getattr(self, k) for k in self._UNDO}
    def restore(self, state:dict):
        for k,v in state.items(): setattr(self, k, v)

    def __repr__(self): return (f"Window(n_micro={self.n_micro}, n_samples={self.n_samples}, items={self.items}, "
                                f"target={self.target}, action={self.action!r}, phase={self.phase.name})")

# a window's state (`Window.state_dict`), field by field: what `load_state_dict` accepts
_FIELDS = dict(n_micro=int, n_samples=int, n_units=int, items=_NUM, loss_sum=_NUM, ref=(_NONE, *_NUM),
               hypers=(_NONE, list),
               target=(_NONE, int, float), unit_action=(_NONE, str), summed=(bool,), bs=(_NONE, int),
               action=(_NONE, str),
               phase=(Phase,), n=(_NONE, *_NUM), pending=(_NONE, *_NUM), record=(_NONE, StepRecord))
