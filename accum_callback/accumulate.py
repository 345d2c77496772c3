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

from .guard import add_fit_guard, remove_fit_guard, in_inference
from .schedule import WindowSchedule, as_window_schedule

__all__ = ['GradientAccumulation', 'Window', 'PARTIAL_MODES']

PARTIAL_MODES = ('step', 'drop', 'carry')

def _is_ddp(model)->bool: return isinstance(model, DistributedDataParallel)

def _records_cuda_graphs(model)->bool:
    "Is any part of `model` a `torch.compile` module whose backend records CUDA graphs (mode='reduce-overhead'/'max-autotune')?"
    for m in model.modules():
        if not hasattr(m, '_orig_mod'): continue
        f = getattr(getattr(m, 'dynamo_ctx', None), 'callback', None)
        for _ in range(8):   # CatchErrorsWrapper -> ConvertFrame -> backend wrapper with the inductor options
            if f is None: break
            cfg = getattr(f, 'config', None)
            if isinstance(cfg, dict) and cfg.get('triton.cudagraphs'): return True
            f = getattr(f, '_torchdynamo_orig_backend', None)
    return False

class Window:
    """The accumulation window in progress, as a plain record: `learn.gradient_accumulation.window`. Its writes skip
    fastai's `Callback.__setattr__` checks (several per micro-batch), and `BatchNormAccumulation` and tests read it.

    Window fields: `n_micro` micro-batches counted (back-propagated), `n_samples`, `items` (the `n_items` sum),
    `loss_sum` (item-weighted), `ref` (the loss-scale reference), `hypers` (the hyper-parameters its step uses),
    `target` (its size in micro-batches or items). Current micro-batch: `bs`, `action` ('step', 'drop' or None: the
    window stays open), `n` (its items, None until/unless its backward runs), `counted` (its backward ran and counts)."""
    __slots__ = ('n_micro', 'n_samples', 'items', 'loss_sum', 'ref', 'hypers', 'target',
                 'bs', 'action', 'n', 'counted', 'resolved', 'step_cancelled', 'log', 'hypers_now', 'no_sync')
    def __init__(self): self.reset(); self.start_micro(); self.hypers_now = self.no_sync = None
    def reset(self):
        "Forget the window (what its micro-batches left in the gradients is the caller's to step or zero)"
        self.n_micro,self.n_samples,self.items,self.loss_sum,self.ref,self.hypers,self.target = 0,0,0.,0.,None,None,None
    def start_micro(self, bs:int=0, action=None):
        self.bs,self.action,self.n,self.counted,self.resolved,self.step_cancelled,self.log = bs,action,None,False,False,False,None
    @property
    def is_open(self)->bool: "Has a micro-batch been counted since the last step?"; return self.n_micro > 0
    def __repr__(self): return (f"Window(n_micro={self.n_micro}, n_samples={self.n_samples}, items={self.items}, "
                                f"target={self.target}, action={self.action!r})")

class GradientAccumulation(Callback):
    "Accumulate gradients over micro-batches; each optimizer step applies exactly the mean gradient of its window"
    # Before `MixedPrecision` (10) and `GradientClip` (11) in `before_step`: the scaler unscales, checks and updates,
    # and clipping clips, once per window and on the finished window gradient. `_only_train_loop`: `learn.summary()`
    # runs its forward without us.
    order,run_valid,_only_train_loop = MixedPrecision.order-4,False,True

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
        self._warned_divide,self._new_fit,self._listeners = False,False,[]
        self.window = Window()
        self._reset_logs()

    # -- public state -------------------------------------------------------------------------------------------
    @property
    def sched(self)->WindowSchedule: return self.n_step_sched or self.target_bs_sched
    @property
    def steps(self)->int: "Optimizer steps taken in the last (or current) `fit`"; return len(self.window_sizes)
    @property
    def window_n_step(self)->int:
        "Micro-batches a full window takes now (for `target_bs`: at the training loader's batch size)"
        t = self.window.target
        if self.n_step_sched is not None: return t if t else self.n_step_sched()
        return max(1, math.ceil((t if t else self.target_bs_sched())/self.dls.train.bs))
    @property
    def window_start(self)->bool: "Is the micro-batch being processed the first of its window?"; return self.window.n_micro == 0
    @property
    def closes(self)->bool: "Does the micro-batch being processed close its window (step or drop)?"; return self.window.action is not None

    def on_window_close(self, fn):
        "Call `fn(stepped:bool)` each time a window closes: stepped, or dropped/skipped/cancelled with its gradients zeroed"
        if fn not in self._listeners: self._listeners.append(fn)
        return fn
    def remove_window_listener(self, fn):
        if fn in self._listeners: self._listeners.remove(fn)

    def _reset_logs(self):
        self.window_sizes,self.window_items,self.window_losses = [],[],[]  # per optimizer step: samples, items, mean loss
        self.window_micro = []   # micro-batches per optimizer step
        self.n_skipped,self.n_dropped,self.n_step_cancelled = 0,0,0

    # -- fit ----------------------------------------------------------------------------------------------------
    def before_fit(self):
        # fastai sends `before_fit`/`after_fit` around `validate`, `get_preds`, `predict` and `tta` too, holding the
        # Learner's lock: nothing to do there, and a raise would leave the lock held (every later validate hangs)
        if in_inference(self.learn): return
        for cb in self.learn.cbs:
            if isinstance(cb, FastaiGradientAccumulation):
                raise ValueError("Two gradient accumulation callbacks are on this Learner: `accum_callback.GradientAccumulation` "
                                 "and fastai's `fastai.callback.training.GradientAccumulation`; they would both rescale "
                                 "and skip steps. Remove fastai's: `learn.remove_cb(fastai.callback.training.GradientAccumulation)` "
                                 "(or use `learn.accumulate(...)`, which replaces it)")
        if _records_cuda_graphs(self.learn.model):
            raise ValueError("The model is `torch.compile`d with CUDA graphs (mode='reduce-overhead' or 'max-autotune'): their "
                             "reused output buffers corrupt gradients accumulated over several backward passes (PyTorch "
                             "issues 96693, 181723). Compile with `mode='default'` or `mode='max-autotune-no-cudagraphs'`")
        # the logs of the last fit are reset at its first training batch, so they survive a `validate()` after it
        self._new_fit = True
        self.window.reset(); self.window.start_micro()
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
        if in_inference(self.learn): return
        self._end_micro()
        self._discard_window()
        remove_fit_guard(self.learn, 'gradient_accumulation')
        if not self._new_fit and self.n_skipped:   # trained in this fit and dropped windows
            warnings.warn(f"GradientAccumulation: {self.n_skipped} window(s) dropped because a micro-batch gave a "
                          "non-finite loss", stacklevel=2)

    def after_train(self):
        self._end_micro()   # a callback before us may have cancelled the epoch in `after_batch`
        # Only an epoch cut short leaves a window open here (unless carrying it on): never let it leak
        if self.window.n_micro and not (self.partial == 'carry' and self.epoch < self.n_epoch-1): self._discard_window(drop=True)

    # -- batch --------------------------------------------------------------------------------------------------
    def before_batch(self):
        learn,w = self.learn,self.window
        if self._new_fit: self._reset_logs(); self._new_fit = False
        self._end_micro()   # the last micro-batch's `after_batch` did not reach us (cancelled by a callback before us)
        if not w.n_micro: w.target = self.sched(learn.pct_train, learn.epoch)
        bs = find_bs(learn.yb if len(learn.yb) else learn.xb)
        # DDP: every rank must decide alike before the forward pass, so `target_bs` counts micro-batches at the loader's
        # batch size there (a rank's short last batch would otherwise close its window later than the other ranks')
        ddp = _is_ddp(learn.model)
        seen,b = (w.n_micro*learn.dls.train.bs, learn.dls.train.bs) if ddp else (w.n_samples, bs)
        full = (w.n_micro+1 >= w.target) if self.n_step_sched is not None else (seen+b >= w.target)
        if full: action = 'step'
        elif learn.iter != learn.n_iter-1: action = None
        elif self.partial == 'step': action = 'step'
        elif self.partial == 'drop' or learn.epoch >= learn.n_epoch-1: action = 'drop'  # carry ends with the fit
        else: action = None
        w.start_micro(bs, action)
        # DDP: only the micro-batch that steps all-reduces; the others accumulate locally
        if action != 'step' and ddp: w.no_sync = learn.model.no_sync(); w.no_sync.__enter__()

    def before_backward(self):
        learn,w = self.learn,self.window
        n = self.n_items(learn) if self.n_items is not None else w.bs
        if isinstance(n, torch.Tensor): n = n.detach().float().squeeze()
        elif isinstance(n, bool) or not isinstance(n, (Integral, float)):
            raise TypeError(f"`n_items` must return an int or a 0-d tensor, got {type(n).__name__}")
        if not w.n_micro:
            # Hyper-parameters the schedule gives at the window's first micro-batch are the ones its step uses
            w.hypers = [dict(h) for h in learn.opt.hypers]
            # Loss scale reference: the backward loss keeps the size of one mean-reduced loss. Under DDP every rank
            # needs the same constant, so it is the loader's batch size there.
            w.ref = float(learn.dls.train.bs) if _is_ddp(learn.model) else (n.clamp(min=1.) if isinstance(n, torch.Tensor) else max(n, 1))
        w.n = n
        learn.loss_grad = learn.loss_grad * (n/w.ref)

    # Another callback cancelled the backward (before or after our `before_backward`): nothing of it counts
    def after_cancel_backward(self): self.window.n = None

    def after_backward(self):
        w = self.window
        self._exit_no_sync()
        n = w.n
        if n is None: return
        w.n_micro += 1; w.n_samples += w.bs; w.items = w.items + n; w.counted = True
        loss = self.learn.loss.detach().float()
        # a micro-batch of zero items (all ignore_index, all padding) contributes zero, also when its mean loss is NaN
        if isinstance(n, torch.Tensor): w.loss_sum = w.loss_sum + torch.where(n > 0, loss*n, torch.zeros_like(loss))
        elif n > 0: w.loss_sum = w.loss_sum + loss*n

    def before_step(self):
        w = self.window
        # Not the end of a window: skip `opt.step()` *and* `opt.zero_grad()` (CancelStepException would zero them)
        if w.action is None: raise CancelBatchException()
        # Dropped or skipped windows cancel the whole batch, so `after_step` (e.g. the grad scaler's `update`, which
        # needs a `step` first) does not run; their gradients are zeroed here.
        if not w.n_micro: self._close(False); raise CancelBatchException()   # every backward was cancelled
        items,loss_sum = self._window_totals()   # the one host synchronisation per window
        if w.action == 'drop': self.n_dropped += 1; self._close(False); raise CancelBatchException()
        if not (items > 0 and math.isfinite(loss_sum)):
            if self.skip_nonfinite or items <= 0: self.n_skipped += 1; self._close(False); raise CancelBatchException()
        scale = float(w.ref)*(dist.get_world_size() if _is_ddp(self.learn.model) else 1)/items
        grads = [p.grad for p,*_ in self.learn.opt.all_params(with_grad=True)]
        if grads and scale != 1.: torch._foreach_mul_(grads, scale)
        self._use_window_hypers()
        w.log = (w.n_samples, items, loss_sum/items, w.n_micro)

    # The loop calls `after_step` after `after_cancel_step` too (e.g. the grad scaler found an overflow and skipped)
    def after_cancel_step(self): self.window.step_cancelled = True

    def after_step(self):
        w = self.window
        self._put_back_hypers()
        if w.resolved or w.action is None: return
        stepped = w.log is not None and not w.step_cancelled
        if stepped:
            seen,items,loss,mb = w.log
            self.window_sizes.append(seen); self.window_items.append(items); self.window_losses.append(loss)
            self.window_micro.append(mb)
        else: self.n_step_cancelled += 1
        self._close(stepped, zero=False)   # the loop zeroes the gradients right after `after_step`

    def after_batch(self): self._end_micro()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _end_micro(self):
        "Finish the micro-batch: leave no_sync, put hyper-parameters back, and drop a window whose step was cancelled after its backward"
        w = self.window
        self._exit_no_sync(); self._put_back_hypers()
        if w.action is not None and not w.resolved and (w.counted or w.log is not None):
            self.n_step_cancelled += 1; self._close(False)
        w.action = None

    def _close(self, stepped:bool, zero:bool=True):
        "The window is over: stepped, or not (its gradients zeroed); tell the listeners"
        w = self.window
        if not stepped and zero: self._zero_grads()
        w.resolved = True; w.reset()
        for f in self._listeners: f(stepped)

    def _window_totals(self):
        dev = next(self.learn.model.parameters()).device if _is_ddp(self.learn.model) else 'cpu'   # MPS has no float64
        w = self.window
        vals = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(dev) for v in (w.items, w.loss_sum)])
        if _is_ddp(self.learn.model): dist.all_reduce(vals)
        items,loss_sum = vals.tolist()
        return items,loss_sum

    def _use_window_hypers(self):
        "The step uses the window's first hyper-parameters; the ones in force now are kept to be put back after it"
        w,opt = self.window,self.learn.opt
        if not w.hypers: return
        now = [dict(h) for h in opt.hypers]
        keys = [k for k in w.hypers[0] if [h.get(k) for h in w.hypers] != [h.get(k) for h in now]]
        if not keys: return
        w.hypers_now = (now, keys)
        for k in keys: opt.set_hyper(k, [h.get(k) for h in w.hypers])

    def _put_back_hypers(self):
        "After the step: the values a schedule or another callback set (e.g. ReduceLROnPlateau) are in force again"
        w = self.window
        if w.hypers_now is None: return
        now,keys = w.hypers_now; w.hypers_now = None
        for k in keys: self.learn.opt.set_hyper(k, [h.get(k) for h in now])

    def _exit_no_sync(self):
        w = self.window
        if w.no_sync is not None: ctx,w.no_sync = w.no_sync,None; ctx.__exit__(None, None, None)

    def _zero_grads(self):
        if getattr(self.learn, 'opt', None) is not None: self.learn.opt.zero_grad()
        else:
            for p in self.learn.model.parameters():
                if p.grad is not None: p.grad.detach_(); p.grad.zero_()

    def _discard_window(self, drop=False):
        "Zero the gradients of an open window and forget it"
        w = self.window
        self._exit_no_sync(); self._put_back_hypers()
        if drop and w.n_micro: self.n_dropped += 1
        self._zero_grads()
        if w.n_micro: self._close(False, zero=False)
        else: w.reset()

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
