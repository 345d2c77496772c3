"Exact gradient accumulation for fastai: every optimizer step gets the gradient one large batch of the same samples gives"
from __future__ import annotations
import math, time, warnings
from numbers import Integral

import torch
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import patch

from .compat import compiled_with_cuda_graphs, foreach
from .distributed import (all_reduce_grads, check_fsdp, discard_unsharded_grads, enter_no_sync, exit_no_sync, is_distributed,
                          is_fsdp, set_resharding, sum_over_ranks, world_size)
from .guard import CANCELS, add_fit_guard, remove_fit_guard, in_inference
from .losses import loss_items, loss_reduction
from .micro import MicroBatcher, MicroBatches, is_out_of_memory
from .schedule import WindowSchedule, as_window_schedule

__all__ = ['GradientAccumulation', 'Window', 'MicroBatches', 'PARTIAL_MODES', 'is_out_of_memory']

PARTIAL_MODES = ('step', 'drop', 'carry')

class Window:
    """The accumulation window in progress, as a plain record: `learn.gradient_accumulation.window`. Its writes skip
    fastai's `Callback.__setattr__` checks (several per micro-batch), and `BatchNormAccumulation` and tests read it.

    Window fields: `n_micro` micro-batches counted (back-propagated), `n_samples`, `items` (the `n_items` sum),
    `loss_sum` (item-weighted), `ref` (the loss-scale reference), `hypers` (the hyper-parameters its step uses),
    `target` (its size in micro-batches or items; loader batches or items with `micro_bs`), `n_units` (loader batches
    begun, with `micro_bs`). Current micro-batch: `bs`, `action` ('step', 'drop' or None: the
    window stays open), `n` (its items, None until/unless its backward runs), `counted` (its backward ran and counts)."""
    __slots__ = ('n_micro', 'n_samples', 'items', 'loss_sum', 'ref', 'hypers', 'target', 'n_units', 'unit_action',
                 'bs', 'action', 'n', 'counted', 'resolved', 'step_cancelled', 'log', 'hypers_now', 'no_sync', 'summed')
    def __init__(self): self.reset(); self.start_micro(); self.hypers_now = self.no_sync = None
    def reset(self):
        "Forget the window (what its micro-batches left in the gradients is the caller's to step or zero)"
        self.n_micro,self.n_samples,self.items,self.loss_sum,self.ref,self.hypers,self.target = 0,0,0.,0.,None,None,None
        self.n_units,self.unit_action = 0,None   # with `micro_bs`: loader batches in the window, and the last one's decision
        self.summed = False   # the loss sums over its items (`reduction='sum'`): the window's gradient is the sum
    def start_micro(self, bs:int=0, action=None):
        self.bs,self.action,self.n,self.counted,self.resolved,self.step_cancelled,self.log = bs,action,None,False,False,False,None
    @property
    def is_open(self)->bool: "Has a micro-batch been counted since the last step?"; return self.n_micro > 0
    def __repr__(self): return (f"Window(n_micro={self.n_micro}, n_samples={self.n_samples}, items={self.items}, "
                                f"target={self.target}, action={self.action!r})")

_UNDO_FIELDS = tuple(k for k in Window.__slots__ if k not in ('n_units', 'unit_action', 'target'))   # put back by an undo

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
        n_acc:int=None, # fastai's spelling: items per optimizer step, = `target_bs` with windows carried over epochs as fastai does
        partial:str=None, # partial window at the end of an epoch: 'step' it (default), 'drop' it, or 'carry' it into the next
        n_items:callable=None, # `f(learn)` -> items the micro-batch's mean loss averages over (default: a known weighted/ignore_index loss's count, else the batch size)
        skip_nonfinite:bool=True, # drop a window in which any micro-batch gave a non-finite loss
        micro_bs:int|str|None=None, # cut every loader batch into micro-batches of this many items; 'auto': the fastest that fits
        probe:bool=True, # micro_bs='auto' on a GPU: once settled, time the next smaller size too and keep the faster
        sharded_grads:bool=False, # FSDP2: reduce-scatter every micro-batch so gradients stay sharded (1/world the memory, k rounds a window)
        gathered_params:bool=False, # FSDP2: keep parameters gathered through a window (one all-gather a window, not 1-2 a micro-batch)
    ):
        if micro_bs is not None and not (micro_bs == 'auto' or (isinstance(micro_bs, Integral) and not isinstance(micro_bs, bool) and micro_bs >= 1)):
            raise ValueError(f"`micro_bs` must be a whole number >= 1, 'auto' or None, got {micro_bs!r}")
        if n_step is None and target_bs is None and n_acc is None and micro_bs is None: n_acc = 32   # fastai's default
        if n_acc is not None:   # fastai's callback: `n_acc` counts items (a float such as 1e6 too); windows span epochs
            if target_bs is not None: raise ValueError(f"Give `target_bs` or fastai's `n_acc` (the same thing), not both; got {target_bs!r} and {n_acc!r}")
            if isinstance(n_acc, float) and n_acc.is_integer(): n_acc = int(n_acc)
            target_bs,partial = n_acc,('carry' if partial is None else partial)
        self.n_acc = n_acc   # fastai's rule: a window closes at the first batch reaching it, so no warning when it does not divide
        if partial is None: partial = 'step'
        if n_step is not None and target_bs is not None:
            raise ValueError("Give exactly one of `n_step` (micro-batches per optimizer step) or `target_bs` "
                             f"(items per optimizer step), or `micro_bs` alone (one step per loader batch); got "
                             f"n_step={n_step!r}, target_bs={target_bs!r}")
        if not isinstance(probe, bool): raise TypeError(f"`probe` must be True or False, got {probe!r}")
        if not isinstance(sharded_grads, bool): raise TypeError(f"`sharded_grads` must be True or False, got {sharded_grads!r}")
        if not isinstance(gathered_params, bool): raise TypeError(f"`gathered_params` must be True or False, got {gathered_params!r}")
        if micro_bs is not None and n_step is None and target_bs is None: n_step = 1   # the window is the loader batch
        if not isinstance(partial, str) or partial not in PARTIAL_MODES:
            raise ValueError(f"`partial` must be one of {PARTIAL_MODES}, got {partial!r}")
        if n_items is not None and not callable(n_items):
            raise TypeError(f"`n_items` must be a function `f(learn) -> int` or None, got {type(n_items).__name__}")
        if not isinstance(skip_nonfinite, bool): raise TypeError(f"`skip_nonfinite` must be True or False, got {skip_nonfinite!r}")
        self.n_step_sched = as_window_schedule(n_step, 'n_step')
        self.target_bs_sched = as_window_schedule(target_bs, 'target_bs' if n_acc is None else 'n_acc')
        self.partial,self.n_items,self.skip_nonfinite,self.probe = partial,n_items,skip_nonfinite,probe
        self.sharded_grads,self.gathered_params = sharded_grads,gathered_params
        # micro_bs: the loader's batches cut into micro-batches (`accum_callback.micro`); its size in `micro_bs`
        self.micro = (MicroBatcher(micro_bs, probe, self._window_state, self._restore_window, clock=self._clock,
                                   on_gpu=self._probe_here) if micro_bs is not None else None)   # bound methods: it pickles
        self._decided,self._checked_sync_bn,self._warned_divide,self._new_fit,self._listeners = 0,False,False,False,[]
        self.window = Window()
        self._reset_logs()

    # -- public state -------------------------------------------------------------------------------------------
    @property
    def sched(self)->WindowSchedule: return self.n_step_sched or self.target_bs_sched
    @property
    def micro_bs(self)->int|None:
        "The micro-batch size in use: fixed, or what 'auto' found (kept for the next fit on this Learner); None without `micro_bs`"
        return self.micro.size if self.micro is not None else None
    @property
    def micro_bs_mode(self): "The `micro_bs` argument: a number, 'auto' or None"; return self.micro.mode if self.micro is not None else None
    @property
    def micro_bs_trials(self)->dict: "micro_bs='auto' on a GPU: items/s the probe measured per size"; return self.micro.trials if self.micro is not None else {}
    @property
    def inference_bs(self)->int|None:
        "micro_bs='auto': the largest inference batch that fitted after an out-of-memory error (None: not cut)"
        return self.micro.inference_bs if self.micro is not None else None
    @property
    def steps(self)->int: "Optimizer steps taken in the last (or current) `fit`"; return len(self.window_sizes)
    @property
    def window_n_step(self)->int:
        "Micro-batches a full window takes now (for `target_bs`: at the training loader's batch size)"
        t,bs = self.window.target,self.dls.train.bs or self.window.bs or 1   # a loader of ready-made batches has no bs
        if self.n_step_sched is not None: k = t if t else self.n_step_sched()
        else: k = max(1, math.ceil((t if t else self.target_bs_sched())/bs))
        if self.micro_bs: k *= math.ceil(bs/self.micro_bs)   # loader batches, each cut into micro-batches
        return k
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
    def on_micro_undo(self, fn):
        "Call `fn()` when `micro_bs='auto'` undoes a micro-batch (out of memory, or cancelled on another DDP rank)"
        if self.micro is not None and fn not in self.micro.undo_listeners: self.micro.undo_listeners.append(fn)
        return fn
    def remove_undo_listener(self, fn):
        if self.micro is not None and fn in self.micro.undo_listeners: self.micro.undo_listeners.remove(fn)

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
        check_fsdp(self.learn.model)
        if compiled_with_cuda_graphs(self.learn.model):
            raise ValueError("The model is `torch.compile`d with CUDA graphs (mode='reduce-overhead' or 'max-autotune'): their "
                             "reused output buffers corrupt gradients accumulated over several backward passes (PyTorch "
                             "issues 96693, 181723). Compile with `mode='default'` or `mode='max-autotune-no-cudagraphs'`")
        # the logs of the last fit are reset at its first training batch, so they survive a `validate()` after it
        self._new_fit = True
        self.window.reset(); self.window.start_micro()
        self._zero_grads()      # nothing left by an earlier fit (or by hand) leaks into the first window
        add_fit_guard(self.learn, 'gradient_accumulation',   # KeyboardInterrupt, errors (the fit goes on after cancels)
                      lambda e: self._discard_window() or isinstance(e, CANCELS) or self._unhook_loop())
        if self.micro is not None: self.micro.start_fit(self.learn)   # refuses a model whose state it cannot split
        bs = getattr(self.dls.train, 'bs', None)
        if self.target_bs_sched is not None and bs and not self._warned_divide and self.n_acc is None:
            t = self.target_bs_sched()
            if t % bs:
                warnings.warn(f"GradientAccumulation: micro-batch size {bs} does not divide target_bs={t}: windows "
                              f"close at the first micro-batch reaching it ({math.ceil(t/bs)*bs} items); each step is "
                              "still the exact mean gradient of its window", stacklevel=2)
                self._warned_divide = True

    def after_fit(self):
        if in_inference(self.learn): return self._unhook_loop()   # `validate`/`get_preds` under 'auto' (also after an error)
        self._end_micro()
        self._discard_window()
        self._unhook_loop()
        remove_fit_guard(self.learn, 'gradient_accumulation')
        if not self._new_fit and self.n_skipped:   # trained in this fit and dropped windows
            warnings.warn(f"GradientAccumulation: {self.n_skipped} window(s) dropped because a micro-batch gave a "
                          "non-finite loss", stacklevel=2)

    def before_train(self):   # (the loader is cut by `micro._CutLoader`, after callbacks that replace it)
        check_fsdp(self.learn.model)   # a model another callback sharded in its `before_fit` (Accelerate's FSDP plugin)

    def after_train(self):
        if self.micro is not None: self.micro.end_train()
        if self.gathered_params and is_fsdp(self.learn.model): set_resharding(self.learn.model, True, True, now=True)
        self._end_micro()   # a callback before us may have cancelled the epoch in `after_batch`
        # Only an epoch cut short leaves a window open here (unless carrying it on): never let it leak
        if self.window.n_micro and not (self.partial == 'carry' and self.epoch < self.n_epoch-1): self._discard_window(drop=True)

    # `validate`, `get_preds`, `predict`, `tta` and fit's validation under micro_bs='auto': cut a batch that runs out of memory
    def before_validate(self):
        if self.micro is not None and in_inference(self.learn): self.micro.start_inference(self.learn)
    def after_validate(self):
        if self.micro is not None and in_inference(self.learn): self.micro.end_inference()

    # -- batch --------------------------------------------------------------------------------------------------
    def before_batch(self):
        learn,w = self.learn,self.window
        sp = self.micro.loader if self.micro is not None else None
        if self._new_fit: self._reset_logs(); self._new_fit = False
        self._end_micro()   # the last micro-batch's `after_batch` did not reach us (cancelled by a callback before us)
        bs = find_bs(learn.yb if len(learn.yb) else learn.xb)
        ddp = self._dist()
        if sp is None:   # a micro-batch is a loader batch: decide at each
            if not w.n_micro: w.target = self.sched(learn.pct_train, learn.epoch)
            action = self._decide(bs, w.n_micro, w.n_samples, learn.iter == learn.n_iter-1, ddp)
        else:   # `micro_bs`: decide once per loader batch (a retried micro-batch keeps it); its last micro-batch acts
            if self._decided != sp.serial:
                if not w.n_units: w.target = self.sched(learn.pct_train, learn.epoch)
                w.unit_action = self._decide(sp.batch_n, w.n_units, w.n_samples, sp.last_batch, ddp)
                w.n_units += 1; self._decided = sp.serial
            action = w.unit_action if sp.last_chunk else None
        w.start_micro(bs, action)
        # DDP: only the micro-batch that steps all-reduces; the others accumulate locally. With micro_bs='auto' none
        # does: a rank may retry a micro-batch, so the gradients are all-reduced in `before_step`, after the ranks agree
        manual = self._ranks_retry()
        fsdp = is_fsdp(learn.model)
        if (action != 'step' or manual) and not (self.sharded_grads and fsdp): w.no_sync = enter_no_sync(learn.model)
        # FSDP2 `gathered_params`: parameters stay gathered from the window's first forward to its last backward
        if fsdp and self.gathered_params: set_resharding(learn.model, forward=False, backward=action is not None)
        if manual and not self._checked_sync_bn:
            if any(isinstance(m, torch.nn.SyncBatchNorm) for m in learn.model.modules()):
                raise ValueError("GradientAccumulation(micro_bs='auto') under DDP cannot retry a micro-batch through "
                                 "SyncBatchNorm (its forward waits for every rank): give `micro_bs` a number")
            self._checked_sync_bn = True
        if sp is not None: self.micro.before_forward()

    def after_pred(self):
        if self.micro is not None: self.micro.after_forward()

    def _decide(self, b:int, units:int, seen:int, last:bool, ddp:bool):
        "'step', 'drop' or None (the window stays open) for a unit (micro-batch, or loader batch with `micro_bs`) of `b` items"
        w,learn = self.window,self.learn
        # DDP: every rank must decide alike before the forward pass, so `target_bs` counts units at the loader's batch
        # size there (a rank's short last batch would otherwise close its window later than the other ranks')
        if ddp: seen,b = units*learn.dls.train.bs,learn.dls.train.bs
        full = (units+1 >= w.target) if self.n_step_sched is not None else (seen+b >= w.target)
        if full: return 'step'
        if not last: return None
        if self.partial == 'step': return 'step'
        if self.partial == 'drop' or learn.epoch >= learn.n_epoch-1: return 'drop'   # carry ends with the fit
        return None

    def before_backward(self):
        learn,w = self.learn,self.window
        # the count the loss averages over: the user's `n_items`, that of a known weighted / ignore_index loss, or the batch size
        n = self.n_items(learn) if self.n_items is not None else loss_items(learn.loss_func, learn.yb)
        if n is None: n = w.bs
        if isinstance(n, torch.Tensor): n = n.detach().float().squeeze()
        elif isinstance(n, bool) or not isinstance(n, (Integral, float)):
            raise TypeError(f"`n_items` must return an int or a 0-d tensor, got {type(n).__name__}")
        if not w.n_micro:
            # Hyper-parameters the schedule gives at the window's first micro-batch are the ones its step uses
            w.hypers = [dict(h) for h in learn.opt.hypers]
            # Loss scale reference: the backward loss keeps the size of one mean-reduced loss. Under DDP every rank
            # needs the same constant, so it is the loader's batch size there.
            w.ref = float(learn.dls.train.bs) if self._dist() else (n.clamp(min=1.) if isinstance(n, torch.Tensor) else max(n, 1))
            # a known loss class with reduction='sum': the big batch's loss is the sum of the micro-batches' sums
            w.summed = loss_reduction(learn.loss_func) == 'sum'
        w.n = n
        if not w.summed: learn.loss_grad = learn.loss_grad * (n/w.ref)

    # Another callback cancelled the backward (before or after our `before_backward`): nothing of it counts
    def after_cancel_backward(self): self.window.n = None

    def after_backward(self):
        w = self.window
        if self.micro is not None: self.micro.after_backward(counted=w.n is not None)   # 'auto' + DDP: the ranks agree
        self._exit_no_sync()
        n = w.n
        if n is None: return
        w.n_micro += 1; w.n_samples += w.bs; w.items = w.items + n; w.counted = True
        loss = self.learn.loss.detach().float()
        # a micro-batch of zero items (all ignore_index, all padding) contributes zero, also when its mean loss is NaN
        if w.summed: w.loss_sum = w.loss_sum + loss
        elif isinstance(n, torch.Tensor): w.loss_sum = w.loss_sum + torch.where(n > 0, loss*n, torch.zeros_like(loss))
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
        if self._ranks_retry(): all_reduce_grads([p for p,*_ in self.learn.opt.all_params()]); world = 1   # none ran in no_sync
        else: world = world_size(self.learn.model)   # DDP averaged the gradients over the ranks
        scale = float(world) if w.summed else float(w.ref)*world/items   # DDP averaged over the ranks: undo that for a sum
        grads = [p.grad for p,*_ in self.learn.opt.all_params(with_grad=True)]
        if grads and scale != 1.: foreach('mul_')(grads, scale)
        self._use_window_hypers()
        w.log = (w.n_samples, items, loss_sum/items, w.n_micro)

    # The loop calls `after_step` after `after_cancel_step` too (e.g. the grad scaler found an overflow and skipped)
    def after_cancel_step(self): self.window.step_cancelled = True

    def after_step(self):
        w = self.window
        self._put_back_hypers()
        # A callback ordered before us cancelled the step of a micro-batch that does not close its window (our
        # `before_step` did not run): skip the loop's `zero_grad`, which would empty the window's first part
        if w.action is None and w.step_cancelled and not w.resolved: raise CancelBatchException()
        if w.resolved or w.action is None: return
        stepped = w.log is not None and not w.step_cancelled
        if stepped:
            seen,items,loss,mb = w.log
            self.window_sizes.append(seen); self.window_items.append(items); self.window_losses.append(loss)
            self.window_micro.append(mb)
        else: self.n_step_cancelled += 1
        self._close(stepped, zero=False)   # the loop zeroes the gradients right after `after_step`

    def after_cancel_batch(self):
        if self.micro is not None: self.micro.after_cancel_batch()   # 'auto' + DDP: a rank that cancelled agrees here

    def after_batch(self):
        self._end_micro()
        p = self.micro.progress() if self.micro is not None else None
        if p is not None:   # progress by loader batches, as without `micro_bs` (schedules see the same)
            learn = self.learn
            learn.pct_train = (learn.epoch + p)/learn.n_epoch

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
        items,loss_sum = sum_over_ranks([self.window.items, self.window.loss_sum], self.learn.model)
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
        if w.no_sync is not None: ctx,w.no_sync = w.no_sync,None; exit_no_sync(ctx)

    def _zero_grads(self):
        if is_fsdp(self.learn.model):   # held by FSDP2 where zero_grad does not reach
            discard_unsharded_grads(self.learn.model)
            if self.gathered_params: set_resharding(self.learn.model, True, True, now=True)
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

    # -- micro_bs ------------------------------------------------------------------------------------------------
    def _unhook_loop(self):
        if self.micro is not None: self.micro.unhook()

    def _window_state(self)->tuple[dict,bool]:
        "What an undone micro-batch puts back in the window, and whether the window holds gradients"
        w = self.window
        return {k: getattr(w, k) for k in _UNDO_FIELDS},bool(w.n_micro)
    def _restore_window(self, state:dict):
        for k,v in state.items(): setattr(self.window, k, v)

    def _probe_here(self)->bool: "Time micro-batch sizes only on a GPU (the size matters there)"; return next(self.learn.model.parameters()).is_cuda
    def _clock(self)->float:
        "Seconds, once the GPU has finished what was queued"
        if torch.cuda.is_available() and next(self.learn.model.parameters()).is_cuda: torch.cuda.synchronize()
        return time.perf_counter()

    def _dist(self)->bool: "DDP or FSDP2: ranks decide alike and sum their window totals"; return is_distributed(self.learn.model)
    def _ranks_retry(self)->bool: "micro_bs='auto' under DDP: the ranks agree on every retry"; return self.micro is not None and self.micro.ranks_agree()

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
    **kwargs # `target_bs`, `partial`, `n_items`, `skip_nonfinite`, `micro_bs`: see `GradientAccumulation`
):
    "Accumulate gradients exactly over micro-batches (replaces any accumulation callback already there)"
    cb = GradientAccumulation(n_step, **kwargs)   # validate before touching the Learner
    self.remove_cbs([c for c in self.cbs if isinstance(c, (GradientAccumulation, FastaiGradientAccumulation))])
    return self.add_cb(cb)

