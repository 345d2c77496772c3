"Exact gradient accumulation for fastai: every optimizer step gets the gradient one large batch of the same samples gives"
from __future__ import annotations
import math, warnings

import torch
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import patch

from .compat import foreach
from .distributed import (all_reduce_grads, check_fsdp, enter_no_sync, exit_no_sync, is_distributed, is_fsdp,
                          set_resharding, sum_over_ranks, world_size, zero_grads)
from .guard import (Listeners, WindowOwner, add_fit_guard, in_inference, one_per_learner, refuse_accumulation_conflicts, refuse_at_fit_start,
                    remove_fit_guard)
from .losses import count_dtype, loss_reduction, micro_items
from .micro import MicroBatching, check_micro_bs, micro_batching
from .micro.loader import CutLoader, ReadAhead, batch_sizes
from .advice import warn_at_fit_start
from .schedule import PARTIAL_MODES, WindowClock, WindowSchedule, decide, window_arguments
from .validate import flag
from .window import Phase, Window

__all__ = ['GradientAccumulation', 'PARTIAL_MODES']

_LOGS = ('window_sizes', 'window_items', 'window_losses', 'window_micro', 'n_skipped', 'n_dropped', 'n_step_cancelled')

@one_per_learner("(`learn.accumulate(...)` replaces the one there; `fit(cbs=...)` and `add_cb` add another.)")
class GradientAccumulation(Callback, WindowOwner):
    "Accumulate gradients over micro-batches; each optimizer step applies exactly the mean gradient of its window"
    # Before `MixedPrecision` (10) and `GradientClip` (11) in `before_step`: the scaler unscales, checks and updates,
    # and clipping clips, once per window and on the finished window gradient. `_only_train_loop`: `learn.summary()`
    # runs its forward without us.
    order,run_valid,_only_train_loop = MixedPrecision.order-4,False,True

    def __init__(self,
        count:int|None=None, # without a name: read as `n_step`, with a warning at fit start (fastai's positional argument counts samples, `n_acc`): name it
        /, *,
        n_step:int|dict|callable=None, # micro-batches per optimizer step (or an `{epoch: n}` mapping / function of progress)
        target_bs:int|dict|callable=None, # items per optimizer step: a window closes at the first micro-batch reaching it
        n_acc:int=None, # fastai's spelling: items per optimizer step, = `target_bs` with windows carried over epochs as fastai does
        partial:str=None, # partial window at the end of an epoch: 'step' it (default), 'drop' it, or 'carry' it into the next
        n_items:callable=None, # `f(learn)` -> items the micro-batch's mean loss averages over (default: a known weighted/ignore_index loss's count, else the batch size)
        skip_nonfinite:bool=True, # drop a window in which any micro-batch gave a non-finite loss
        micro_bs:int|str|None=None, # cut every loader batch into micro-batches of this many items; 'auto': the fastest that fits (adds `MicroBatching`)
        probe:bool=True, # micro_bs='auto' on a GPU: once settled, time the next smaller size too and keep the faster
        sharded_grads:bool=False, # FSDP2: reduce-scatter every micro-batch so gradients stay sharded (1/world the memory, k rounds a window)
        gathered_params:bool=False, # FSDP2: keep parameters gathered through a window (one all-gather a window, not 1-2 a micro-batch)
    ):
        if micro_bs is not None: check_micro_bs(micro_bs)
        if count is not None:
            if n_step is not None: raise TypeError(f"GradientAccumulation: a count ({count!r}) and `n_step` ({n_step!r}): give one, by name")
            n_step = count
        self.count = count   # fastai's recipes write `GradientAccumulation(64)` for 64 samples: said at fit start
        self.n_step_sched,self.target_bs_sched,self.partial = window_arguments(n_step, target_bs, n_acc, partial, cut=micro_bs is not None)
        self.n_acc = n_acc   # fastai's rule: a window closes at the first batch reaching it, so no warning when it does not divide
        if n_items is not None and not callable(n_items):
            raise TypeError(f"`n_items` must be a function `f(learn) -> int` or None, got {type(n_items).__name__}")
        self.n_items,self.skip_nonfinite = n_items,flag(skip_nonfinite, 'skip_nonfinite')
        self.sharded_grads,self.gathered_params = flag(sharded_grads, 'sharded_grads'),flag(gathered_params, 'gathered_params')
        # `micro_bs`: the `MicroBatching` callback this one adds to its Learner (and takes away with it)
        self.companion = MicroBatching(micro_bs, flag(probe, 'probe')) if micro_bs is not None else None
        self.mb,self._decided,self._new_fit,self._listeners = None,0,False,Listeners()
        self.said = set()   # what `advice` has said at fit start (once each: 'window', 'layers', 'fsdp')
        self._ahead,self._clock = None,WindowClock()   # the training loader read ahead; the schedule's clock in windows
        self.window = Window()
        self._reset_logs()

    # -- public state -------------------------------------------------------------------------------------------
    @property
    def learn(self): return self.__dict__.get('_learn')
    @learn.setter
    def learn(self, learn):
        "Added to a Learner (fastai's `add_cb`) with `micro_bs`: add its `MicroBatching` too; removed: take it away"
        mb,old = self.__dict__.get('companion'),self.__dict__.get('_learn')
        if mb is not None and old is not None and learn is not old and mb in old.cbs: old.remove_cb(mb)
        if mb is not None and learn is not None and mb not in learn.cbs: learn.add_cb(mb)   # (a second one: refused at fit start)
        self.__dict__['_learn'] = learn
    @property
    def sched(self)->WindowSchedule: return self.n_step_sched or self.target_bs_sched
    @property
    def steps(self)->int: "Optimizer steps taken in the last (or current) `fit`"; return len(self.window_sizes)
    @property
    def window_n_step(self)->int:
        "Micro-batches a full window takes now (for `target_bs`: at the training loader's batch size)"
        t,bs = self.window.target,self.dls.train.bs or self.window.bs or 1   # a loader of ready-made batches has no bs
        if self.n_step_sched is not None: k = t if t else self.n_step_sched()
        else: k = max(1, math.ceil((t if t else self.target_bs_sched())/bs))
        mb = self._micro()
        return k*mb.pieces(bs) if mb is not None and mb.size else k   # with `micro_bs`: loader batches, each cut
    @property
    def window_start(self)->bool: "Is the micro-batch being processed the first of its window?"; return self.window.n_micro == 0
    @property
    def closes(self)->bool: "Does the micro-batch being processed close its window (step or drop)?"; return self.window.closes
    def on_window_close(self, fn):
        "Call `fn(stepped:bool)` each time a window closes: stepped, or dropped/skipped/cancelled with its gradients zeroed"
        return self._listeners.add(fn)
    def remove_window_listener(self, fn): self._listeners.discard(fn)
    def _reset_logs(self):
        self.window_sizes,self.window_items,self.window_losses = [],[],[]  # per optimizer step: samples, items, mean loss
        self.window_micro = []   # micro-batches per optimizer step
        self.n_skipped,self.n_dropped,self.n_step_cancelled = 0,0,0

    # -- a checkpoint between micro-batches (`accum_callback.checkpoint`) --------------------------------------------
    def state_dict(self)->dict:
        "What the rest of the fit needs of this callback: the window in progress, the logs, the schedule's clock"
        w = self.window
        return dict(window={k: getattr(w, k) for k in Window.__slots__ if k not in ('no_sync', 'hypers_now')},
                    logs={k: getattr(self, k) for k in _LOGS}, clock=dict(vars(self._clock)), decided=self._decided)
    def load_state_dict(self, sd:dict):
        for k,v in sd['window'].items(): setattr(self.window, k, v)
        for k,v in sd['logs'].items(): setattr(self, k, v)
        self._clock.__dict__.update(sd['clock']); self._decided = sd['decided']
        self._new_fit = False   # (the logs are this fit's)

    # -- what `MicroBatching` reads and undoes -------------------------------------------------------------------
    def window_state(self)->tuple[dict,bool]:
        "What undoing the micro-batch in progress puts back in the window (`restore_window`), and whether the window holds gradients"
        return self.window.snapshot(),self.window.is_open
    def restore_window(self, state:dict): self.window.restore(state)
    def _micro(self)->MicroBatching|None:
        return micro_batching(self.learn) if self.learn is not None else None

    # -- fit ----------------------------------------------------------------------------------------------------
    def before_fit(self):
        # fastai sends `before_fit`/`after_fit` around `validate`, `get_preds`, `predict` and `tta` too, holding the
        # Learner's lock: nothing to do there, and a raise would leave the lock held (every later validate hangs)
        if in_inference(self.learn): return
        refuse_at_fit_start(self.learn)   # (ours and the other callbacks of ours: before anything is set up)
        self._new_fit = True   # the logs of the last fit are reset at its first training batch: they survive a `validate()`
        self.window.reset(); self.window.start_micro()
        self._zero_grads()      # nothing left by an earlier fit (or by hand) leaks into the first window
        add_fit_guard(self.learn, 'gradient_accumulation', lambda e: self._unhook())   # errors, KeyboardInterrupt
        self.mb = self._micro()
        self._clock = WindowClock()
        # the loader's real end: read ahead (after any callback that replaces the loader); `MicroBatching` does it itself
        if self.mb is None: self.learn.add_cb(CutLoader(self))
        warn_at_fit_start(self, getattr(self.dls.train, 'bs', None))

    def refuse_fit(self): "What this fit is refused for (`guard.refuse_at_fit_start`)"; refuse_accumulation_conflicts(self.learn)

    def after_fit(self):
        if in_inference(self.learn): return
        self._end_micro(); self._unhook()
        self.mb = None
        remove_fit_guard(self.learn, 'gradient_accumulation')
        if not self._new_fit and self.n_skipped:   # trained in this fit and dropped windows
            warnings.warn(f"GradientAccumulation: {self.n_skipped} window(s) dropped because a micro-batch gave a "
                          "non-finite loss", stacklevel=2)

    def before_train(self): check_fsdp(self.learn.model)   # a model another callback sharded in its `before_fit` (Accelerate's FSDP plugin)
    def start_train(self):
        "(`CutLoader`, once the loader is final) Read the training loader ahead: the window ends where the loader really ends"
        self._ahead = self.learn.dl = ReadAhead(self.learn.dl)

    def _unhook(self):
        "The fit is over (or left by an exception): the window discarded, the loader and the callback list fastai's again"
        self._discard_window()
        learn = self.learn
        if learn is None: return
        if self._ahead is not None: learn.dl,self._ahead = self._ahead.dl,None
        learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, CutLoader) and cb.mb is self])

    def after_train(self):
        if self._ahead is not None: self.learn.dl,self._ahead = self._ahead.dl,None
        if self.gathered_params and is_fsdp(self.learn.model): set_resharding(self.learn.model, True, True, now=True)
        self._end_micro()   # a callback before us may have cancelled the epoch in `after_batch`
        # Only an epoch cut short leaves a window open here (unless carrying it on): never let it leak
        if self.window.n_micro and not (self.partial == 'carry' and self.epoch < self.n_epoch-1): self._discard_window(drop=True)

    # -- batch --------------------------------------------------------------------------------------------------
    def before_batch(self):
        learn,w = self.learn,self.window
        p = self.mb.piece if self.mb is not None else None   # `micro_bs`: the piece of a loader batch being run
        if self._new_fit: self._reset_logs(); self._new_fit = False
        self._end_micro()   # the last micro-batch's `after_batch` did not reach us (cancelled by a callback before us)
        bs,ddp = find_bs(learn.yb if len(learn.yb) else learn.xb),is_distributed(learn.model)
        if self._clock.epoch != learn.epoch: self._start_clock(ddp)
        if p is None:   # a micro-batch is a loader batch: decide at each
            if not w.n_micro: self._window_starts()
            last = self._ahead.last if self._ahead is not None else learn.iter == learn.n_iter-1
            action = self._decide(bs, w.n_micro, w.n_samples, last, ddp)
        else:   # `micro_bs`: decide once per loader batch (a retried micro-batch keeps it); its last micro-batch acts
            if self._decided != p.serial:
                if not w.n_units: self._window_starts()
                w.unit_action = self._decide(p.batch_n, w.n_units, w.n_samples, p.last_batch, ddp)
                w.n_units += 1; self._decided = p.serial
            action = w.unit_action if p.last_piece else None
        w.start_micro(bs, action)
        # DDP: only the micro-batch that steps all-reduces; the others accumulate locally. With micro_bs='auto' none
        # does: a rank may retry a micro-batch, so the gradients are all-reduced in `before_step`, after the ranks agree
        fsdp = is_fsdp(learn.model)
        if (action != 'step' or self._ranks_retry()) and not (self.sharded_grads and fsdp): w.no_sync = enter_no_sync(learn.model)
        # FSDP2 `gathered_params`: parameters stay gathered from the window's first forward to its last backward
        if fsdp and self.gathered_params: set_resharding(learn.model, forward=False, backward=action is not None)

    def _decide(self, b:int, units:int, seen:int, last:bool, ddp:bool):
        "'step', 'drop' or None (the window stays open) for a unit (micro-batch, or loader batch with `micro_bs`) of `b` items"
        learn = self.learn
        # DDP: every rank must decide alike before the forward pass, so `target_bs` counts units at the loader's batch
        # size there (a rank's short last batch would otherwise close its window later than the other ranks')
        if ddp: seen,b = units*learn.dls.train.bs,learn.dls.train.bs
        return decide(b, units, seen, self.window.target, self.n_step_sched is None, last, self.partial,
                      learn.epoch >= learn.n_epoch-1)

    # -- the schedule's clock, in windows ------------------------------------------------------------------------
    def _start_clock(self, ddp:bool):
        "The epoch's windows, for the schedule's clock (`WindowClock`): the loader's real batches, and a window carried in"
        learn,w = self.learn,self.window
        dl = self.mb.loader.dl if self.mb is not None and self.mb.loader is not None else (self._ahead.dl if self._ahead is not None else learn.dl)
        sizes = [learn.dls.train.bs]*len(batch_sizes(dl)) if ddp else batch_sizes(dl)
        self._clock.start_epoch(learn.epoch, learn.n_epoch, sizes, self.sched, self.n_step_sched is None, self.partial,
                                w.n_units if self.mb is not None else w.n_micro, w.n_samples)

    def _window_starts(self):
        "A window starts: the schedule's clock set to the large batch's step it stands for, and the window's size"
        learn = self.learn
        if (pct := self._clock.window_starts()) is not None: learn.pct_train = pct
        self.window.target = self.sched(learn.pct_train, learn.epoch)

    def before_backward(self):
        learn,w = self.learn,self.window
        n = micro_items(learn, self.n_items, w.bs)   # the count the micro-batch's loss averages over
        # the window's first micro-batch: its reference (under DDP the loader's batch size, the same on every rank), the
        # loss's kind, and the hyper-parameters the schedule gives now, which its step uses
        if not w.n_micro: w.begin(n, loss_reduction(learn.loss_func) == 'sum', learn.dls.train.bs if is_distributed(learn.model) else None,
                                  [dict(h) for h in learn.opt.hypers])
        w.pending = n
        if not w.summed: learn.loss_grad = learn.loss_grad * w.loss_weight(n)

    def _scale_lr(self):
        """A window schedule that scales the step's learning rate with the window (`NoiseScaleSchedule(lr=...)`): the
        window's learning rate times its `lr_gain` for the window's size in the schedule's unit, the same on every rank
        (under DDP its micro-batches times the loader's batch size, as the window closed)"""
        gain,w = getattr(getattr(self.sched, 'fn', None), 'lr_gain', None),self.window
        if gain is None or not w.hypers: return
        if self.n_step_sched is not None: size = w.n_units if self.mb is not None else w.n_micro
        else: size = w.n_micro*self.learn.dls.train.bs if is_distributed(self.learn.model) else w.n_samples
        g = gain(size, self.learn.opt)
        if g != 1.: w.hypers = [{**h, 'lr': h['lr']*g} if 'lr' in h else h for h in w.hypers]

    # Another callback cancelled the backward (before or after our `before_backward`): nothing of it counts
    def after_cancel_backward(self): self.window.pending = None

    def after_backward(self):
        w = self.window
        w.exit_no_sync()
        if w.pending is None: return
        loss = self.learn.loss.detach()
        w.add(w.pending, w.bs, loss.to(count_dtype(loss)))

    def before_step(self):
        w,opt = self.window,self.learn.opt
        # Not the end of a window: skip `opt.step()` *and* `opt.zero_grad()` (CancelStepException would zero them)
        if w.action is None: raise CancelBatchException()
        # Dropped or skipped windows cancel the whole batch, so `after_step` (e.g. the grad scaler's `update`, which
        # needs a `step` first) does not run; their gradients are zeroed here.
        if not w.n_micro: self._close(False); raise CancelBatchException()   # every backward was cancelled
        items,loss_sum = sum_over_ranks([w.items, w.loss_sum], self.learn.model)   # the one host synchronisation a window
        if w.action == 'drop': self.n_dropped += 1; self._close(False); raise CancelBatchException()
        if not (items > 0 and math.isfinite(loss_sum)):
            if self.skip_nonfinite or items <= 0: self.n_skipped += 1; self._close(False); raise CancelBatchException()
        if self._ranks_retry(): all_reduce_grads([p for p,*_ in opt.all_params()]); world = 1   # none ran in no_sync
        else: world = world_size(self.learn.model)   # DDP averaged the gradients over the ranks
        scale = w.step_scale(items, world)
        grads = [p.grad for p,*_ in opt.all_params(with_grad=True)]
        if grads and scale != 1.: foreach('mul_')(grads, scale)
        self._scale_lr()
        w.use_hypers(opt)
        w.stepping(items, loss_sum)

    # The loop calls `after_step` after `after_cancel_step` too (e.g. the grad scaler found an overflow and skipped)
    def after_cancel_step(self): self.window.step_cancelled()

    def after_step(self):
        w = self.window
        w.put_back_hypers(self.learn.opt)
        # A callback ordered before us cancelled the step of a micro-batch that does not close its window (our
        # `before_step` did not run): skip the loop's `zero_grad`, which would empty the window's first part
        if w.action is None and w.phase is Phase.CANCELLED: raise CancelBatchException()
        if w.closed or w.action is None: return
        if w.stepped:
            r = w.record
            self.window_sizes.append(r.samples); self.window_items.append(r.items); self.window_losses.append(r.loss); self.window_micro.append(r.micro)
        else: self.n_step_cancelled += 1
        self._close(w.stepped, zero=False)   # the loop zeroes the gradients right after `after_step`

    def after_batch(self): self._end_micro()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _end_micro(self):
        "Finish the micro-batch: leave no_sync, put hyper-parameters back, and drop a window whose step was cancelled after its backward"
        w = self.window
        w.exit_no_sync(); w.put_back_hypers(self.learn.opt)
        if w.action is not None and not w.closed and (w.counted or w.record is not None):
            self.n_step_cancelled += 1; self._close(False)
        w.end_micro()

    def _close(self, stepped:bool, zero:bool=True):
        "The window is over: stepped, or not (its gradients zeroed); tell the listeners"
        if not stepped and zero: self._zero_grads()
        self.window.close()
        self._listeners(stepped)

    def _zero_grads(self): zero_grads(self.learn.model, getattr(self.learn, 'opt', None), reshard=self.gathered_params)

    def _discard_window(self, drop=False):
        "Zero the gradients of an open window and forget it"
        w = self.window
        w.exit_no_sync(); w.put_back_hypers(getattr(self.learn, 'opt', None))
        if drop and w.n_micro: self.n_dropped += 1
        self._zero_grads()
        if w.n_micro: self._close(False, zero=False)
        else: w.reset()

    def _ranks_retry(self)->bool: "micro_bs='auto' under DDP: the ranks agree on every retry"; return self.mb is not None and self.mb.manual_sync

    def plot_windows(self, ax=None):
        """Plot each optimizer step's item-weighted window loss against optimizer steps; returns the axes (a notebook
        shows the figure; a script: `plt.show()`, or `ax.figure.savefig(...)`, labels inside the saved figure)"""
        import matplotlib.pyplot as plt
        new = ax is None
        if new: _,ax = plt.subplots(figsize=(6,3.5))
        ax.plot(range(1, self.steps+1), self.window_losses)
        ax.set_xlabel('optimizer step'); ax.set_ylabel('window loss (item-weighted mean)')
        if new: ax.figure.tight_layout()
        return ax

@patch
def accumulate(self:Learner,
    n_step:int|dict|callable=None, # micro-batches per optimizer step
    **kwargs # `target_bs`, `n_acc` (fastai's: samples per step), `partial`, `n_items`, `skip_nonfinite`, `micro_bs`: see `GradientAccumulation`
):
    """Accumulate gradients exactly over micro-batches (replaces any accumulation callback already there, ours or
    fastai's). A recipe that imports `fastai.vision.all` after `accum_callback` gets fastai's `GradientAccumulation`
    back under that name; `learn.accumulate(n_acc=64)` stays ours whatever was imported after"""
    cb = GradientAccumulation(n_step=n_step, **kwargs)   # validate before touching the Learner
    self.remove_cbs([c for c in self.cbs if isinstance(c, (GradientAccumulation, FastaiGradientAccumulation))])
    return self.add_cbs([cb] + ([cb.companion] if cb.companion is not None else []))   # micro_bs: its MicroBatching, explicitly
