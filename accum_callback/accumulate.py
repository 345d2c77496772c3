"Exact gradient accumulation for fastai: every optimizer step gets the gradient one large batch of the same samples gives"
from __future__ import annotations
import math, warnings
from numbers import Integral

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import patch

from .guard import add_fit_guard, remove_fit_guard
from .schedule import WindowSchedule, as_window_schedule

__all__ = ['GradientAccumulation', 'PARTIAL_MODES']

PARTIAL_MODES = ('step', 'drop', 'carry')

def _is_ddp(model)->bool: return isinstance(model, DistributedDataParallel)

class GradientAccumulation(Callback):
    "Accumulate gradients over micro-batches; each optimizer step applies exactly the mean gradient of its window"
    # Before `MixedPrecision` (10) and `GradientClip` (11) in `before_step`: the scaler unscales, checks and updates,
    # and clipping clips, once per window and on the finished window gradient.
    order,run_valid = MixedPrecision.order-4,False

    def __init__(self,
        n_step:int|dict|callable=None, # micro-batches per optimizer step (or an `{epoch: n}` mapping / function of progress)
        *,
        target_bs:int|dict|callable=None, # items per optimizer step: a window closes at the first micro-batch reaching it
        partial:str='step', # partial window at the end of an epoch: 'step' it, 'drop' it, or 'carry' it into the next
        n_items:callable=None, # `f(learn)` -> how many items the micro-batch's mean loss averages over (default: batch size)
        skip_nonfinite:bool=True, # drop a window in which any micro-batch gave a non-finite loss
    ):
        if (n_step is None) == (target_bs is None):
            raise ValueError("Give exactly one of `n_step` (micro-batches per optimizer step) or `target_bs` "
                             f"(items per optimizer step); got n_step={n_step!r}, target_bs={target_bs!r}")
        if not isinstance(partial, str) or partial not in PARTIAL_MODES:
            raise ValueError(f"`partial` must be one of {PARTIAL_MODES}, got {partial!r}")
        if n_items is not None and not callable(n_items):
            raise TypeError(f"`n_items` must be a function `f(learn) -> int` or None, got {type(n_items).__name__}")
        if not isinstance(skip_nonfinite, bool): raise TypeError(f"`skip_nonfinite` must be True or False, got {skip_nonfinite!r}")
        self.n_step_sched,self.target_bs_sched = as_window_schedule(n_step, 'n_step'),as_window_schedule(target_bs, 'target_bs')
        self.partial,self.n_items,self.skip_nonfinite = partial,n_items,skip_nonfinite
        self._warned_divide,self._new_fit = False,False
        self._reset_logs(); self._reset_window()

    # -- public state -------------------------------------------------------------------------------------------
    @property
    def sched(self)->WindowSchedule: return self.n_step_sched or self.target_bs_sched
    @property
    def steps(self)->int: "Optimizer steps taken in the last (or current) `fit`"; return len(self.window_sizes)
    @property
    def window_n_step(self)->int:
        "Micro-batches a full window takes now (for `target_bs`: at the training loader's batch size)"
        if self.n_step_sched is not None: return self._win_target if self._win_target else self.n_step_sched()
        target = self._win_target if self._win_target else self.target_bs_sched()
        return max(1, math.ceil(target/self.dls.train.bs))
    @property
    def window_start(self)->bool: "Is the micro-batch being processed the first of its window?"; return self._mb == 0
    @property
    def closes(self)->bool: "Does the micro-batch being processed close its window (step or drop)?"; return self._action is not None

    def _reset_logs(self):
        self.window_sizes,self.window_items,self.window_losses = [],[],[]  # per optimizer step: samples, items, mean loss
        self.window_micro = []   # micro-batches per optimizer step
        self.n_skipped,self.n_dropped = 0,0

    def _reset_window(self):
        self._mb,self._seen,self._items,self._loss_sum,self._ref,self._hypers = 0,0,0.,0.,None,None
        self._win_target,self._action = None,None

    # -- fit ----------------------------------------------------------------------------------------------------
    def before_fit(self):
        for cb in self.learn.cbs:
            if isinstance(cb, FastaiGradientAccumulation):
                raise ValueError("fastai's own `GradientAccumulation` is also on this Learner: remove it "
                                 "(`learn.remove_cb(...)`), accum_callback's replaces it")
        # fastai sends `before_fit`/`after_fit` around `validate` and `get_preds` too: the logs of the last fit are
        # reset at its first training batch instead, so they survive a `validate()` after it
        self._reset_window(); self._new_fit = True
        self._zero_grads()      # nothing left by an earlier fit (or by hand) leaks into the first window
        add_fit_guard(self.learn, 'gradient_accumulation', lambda e: self._discard_window())  # KeyboardInterrupt, errors
        bs = getattr(self.dls.train, 'bs', None)
        if self.target_bs_sched is not None and bs and not self._warned_divide:
            t = self.target_bs_sched()
            if t % bs:
                warnings.warn(f"GradientAccumulation: micro-batch size {bs} does not divide target_bs={t}: windows "
                              f"close at the first micro-batch reaching it ({math.ceil(t/bs)*bs} items); each step is "
                              "still the exact mean gradient of its window", stacklevel=2)
                self._warned_divide = True

    def after_fit(self):
        self._discard_window()
        remove_fit_guard(self.learn, 'gradient_accumulation')
        if not self._new_fit and self.n_skipped:   # trained in this fit (not a `validate`) and dropped windows
            warnings.warn(f"GradientAccumulation: {self.n_skipped} window(s) dropped because a micro-batch gave a "
                          "non-finite loss", stacklevel=2)

    def after_train(self):
        # Only an epoch cut short leaves a window open here (unless carrying it on): never let it leak
        if self._mb and not (self.partial == 'carry' and self.epoch < self.n_epoch-1): self._discard_window(drop=True)

    # -- batch --------------------------------------------------------------------------------------------------
    def before_batch(self):
        if self._new_fit: self._reset_logs(); self._new_fit = False
        if self._mb == 0: self._win_target = self.sched(self.pct_train, self.epoch)
        self._bs = find_bs(self.yb if len(self.yb) else self.xb)
        # DDP: every rank must decide alike before the forward pass, so `target_bs` counts micro-batches at the loader's
        # batch size there (a rank's short last batch would otherwise close its window later than the other ranks')
        seen,bs = (self._mb*self.dls.train.bs, self.dls.train.bs) if _is_ddp(self.model) else (self._seen, self._bs)
        full = (self._mb+1 >= self._win_target) if self.n_step_sched is not None else (seen+bs >= self._win_target)
        last = self.iter == self.n_iter-1
        if full: self._action = 'step'
        elif not last: self._action = None
        elif self.partial == 'step': self._action = 'step'
        elif self.partial == 'drop' or self.epoch >= self.n_epoch-1: self._action = 'drop'  # carry ends with the fit
        else: self._action = None
        self._did_backward,self._stepped,self._step_cancelled = False,False,False
        # DDP: only the micro-batch that steps all-reduces; the others accumulate locally
        self._no_sync = self.model.no_sync() if self._action != 'step' and _is_ddp(self.model) else None
        if self._no_sync is not None: self._no_sync.__enter__()

    def before_backward(self):
        n = self.n_items(self.learn) if self.n_items is not None else self._bs
        if isinstance(n, torch.Tensor): n = n.detach().float().squeeze()
        elif isinstance(n, bool) or not isinstance(n, (Integral, float)):
            raise TypeError(f"`n_items` must return an int or a 0-d tensor, got {type(n).__name__}")
        if self._mb == 0:
            # Hyper-parameters the schedule gives at the window's first micro-batch are the ones its step uses
            self._hypers = [dict(h) for h in self.opt.hypers]
            # Loss scale reference: the backward loss keeps the size of one mean-reduced loss. Under DDP every rank
            # needs the same constant, so it is the loader's batch size there.
            self._ref = float(self.dls.train.bs) if _is_ddp(self.model) else (n.clamp(min=1.) if isinstance(n, torch.Tensor) else max(n, 1))
        self._n = n
        self.learn.loss_grad = self.loss_grad * (n/self._ref)

    def after_backward(self):
        self._did_backward = True
        self._mb += 1; self._seen += self._bs
        self._items = self._items + self._n
        self._loss_sum = self._loss_sum + self.loss.detach().float()*self._n
        self._exit_no_sync()

    def before_step(self):
        # Not the end of a window: skip `opt.step()` *and* `opt.zero_grad()` (CancelStepException would zero them)
        if self._action is None: raise CancelBatchException()
        items,loss_sum = self._window_totals()   # the one host synchronisation per window
        # A dropped or skipped window cancels the whole batch, so `after_step` (e.g. the grad scaler's `update`,
        # which needs a `step` first) does not run; `after_batch` zeroes the gradients.
        if self._action == 'drop': self.n_dropped += 1; raise CancelBatchException()
        if not (items > 0 and math.isfinite(loss_sum)):
            if self.skip_nonfinite or items <= 0: self.n_skipped += 1; raise CancelBatchException()
        ref = float(self._ref)
        scale = ref*(dist.get_world_size() if _is_ddp(self.model) else 1)/items
        grads = [p.grad for p,*_ in self.opt.all_params(with_grad=True)]
        if grads and scale != 1.: torch._foreach_mul_(grads, scale)
        self._restore_hypers()
        self._log = (self._seen, items, loss_sum/items if items else float('nan'), self._mb)

    # The loop calls `after_step` after `after_cancel_step` too (e.g. the grad scaler found an overflow and skipped)
    def after_cancel_step(self): self._step_cancelled = True
    def after_step(self): self._stepped = not self._step_cancelled

    def after_batch(self):
        self._exit_no_sync()
        if self._action is None or not self._did_backward: return   # window still open
        if self._stepped:
            seen,items,loss,mb = self._log
            self.window_sizes.append(seen); self.window_items.append(items); self.window_losses.append(loss)
            self.window_micro.append(mb)
        else: self._zero_grads()   # dropped, skipped, or cancelled after us: nothing carries into the next window
        self._reset_window()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _window_totals(self):
        dev = next(self.model.parameters()).device if _is_ddp(self.model) else 'cpu'   # MPS has no float64
        vals = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(dev) for v in (self._items, self._loss_sum)])
        if _is_ddp(self.model): dist.all_reduce(vals)
        items,loss_sum = vals.tolist()
        return items,loss_sum

    def _restore_hypers(self):
        if not self._hypers: return
        now = self.opt.hypers
        for k in self._hypers[0]:
            old = [h.get(k) for h in self._hypers]
            if old != [h.get(k) for h in now]: self.opt.set_hyper(k, old)

    def _exit_no_sync(self):
        if getattr(self, '_no_sync', None) is not None: self._no_sync.__exit__(None, None, None); self._no_sync = None

    def _zero_grads(self):
        if getattr(self.learn, 'opt', None) is not None: self.opt.zero_grad()
        else:
            for p in self.model.parameters():
                if p.grad is not None: p.grad.detach_(); p.grad.zero_()

    def _discard_window(self, drop=False):
        "Zero the gradients of an open window and forget it"
        self._exit_no_sync()
        if drop and self._mb: self.n_dropped += 1
        self._zero_grads(); self._reset_window()

    def plot_windows(self, ax=None):
        "Plot each optimizer step's item-weighted window loss against optimizer steps"
        import matplotlib.pyplot as plt
        if ax is None: _,ax = plt.subplots(figsize=(6,3.5))
        ax.plot(range(1, self.steps+1), self.window_losses)
        ax.set_xlabel('optimizer step'); ax.set_ylabel('window loss (item-weighted mean)')
        return ax

@patch
def accumulate(self:Learner,
    n_step:int|dict|callable=None, # micro-batches per optimizer step
    **kwargs # `target_bs`, `partial`, `n_items`, `skip_nonfinite`: see `GradientAccumulation`
):
    "Accumulate gradients exactly over micro-batches (replaces any accumulation callback already there)"
    cb = GradientAccumulation(n_step, **kwargs)   # validate before touching the Learner
    self.remove_cbs([c for c in self.cbs if isinstance(c, (GradientAccumulation, FastaiGradientAccumulation))])
    return self.add_cb(cb)
