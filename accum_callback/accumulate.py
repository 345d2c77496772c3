"Exact gradient accumulation for fastai: every optimizer step gets the gradient one large batch of the same samples gives"
from __future__ import annotations
import gc, math, random, time, warnings
from numbers import Integral

import torch
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import patch

from .distributed import is_ddp as _is_ddp, enter_no_sync, exit_no_sync, sum_over_ranks, world_size
from .guard import CANCELS, add_fit_guard, remove_fit_guard, in_inference
from .schedule import WindowSchedule, as_window_schedule

__all__ = ['GradientAccumulation', 'Window', 'MicroBatches', 'PARTIAL_MODES', 'is_out_of_memory']

PARTIAL_MODES = ('step', 'drop', 'carry')

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
    `target` (its size in micro-batches or items; loader batches or items with `micro_bs`), `n_units` (loader batches
    begun, with `micro_bs`). Current micro-batch: `bs`, `action` ('step', 'drop' or None: the
    window stays open), `n` (its items, None until/unless its backward runs), `counted` (its backward ran and counts)."""
    __slots__ = ('n_micro', 'n_samples', 'items', 'loss_sum', 'ref', 'hypers', 'target', 'n_units', 'unit_action',
                 'bs', 'action', 'n', 'counted', 'resolved', 'step_cancelled', 'log', 'hypers_now', 'no_sync')
    def __init__(self): self.reset(); self.start_micro(); self.hypers_now = self.no_sync = None
    def reset(self):
        "Forget the window (what its micro-batches left in the gradients is the caller's to step or zero)"
        self.n_micro,self.n_samples,self.items,self.loss_sum,self.ref,self.hypers,self.target = 0,0,0.,0.,None,None,None
        self.n_units,self.unit_action = 0,None   # with `micro_bs`: loader batches in the window, and the last one's decision
    def start_micro(self, bs:int=0, action=None):
        self.bs,self.action,self.n,self.counted,self.resolved,self.step_cancelled,self.log = bs,action,None,False,False,False,None
    @property
    def is_open(self)->bool: "Has a micro-batch been counted since the last step?"; return self.n_micro > 0
    def __repr__(self): return (f"Window(n_micro={self.n_micro}, n_samples={self.n_samples}, items={self.items}, "
                                f"target={self.target}, action={self.action!r})")

_OOM_TEXTS = ('out of memory', 'CUBLAS_STATUS_ALLOC_FAILED', 'CUDNN_STATUS_ALLOC_FAILED', 'CUDNN_STATUS_NOT_SUPPORTED',
              'canUse32BitIndexMath')   # cuDNN/cuBLAS's ways of saying a batch is too large for the device

def is_out_of_memory(e:BaseException)->bool:
    "Does `e` say the micro-batch did not fit: `torch.OutOfMemoryError`, or a RuntimeError that means the same"
    if isinstance(e, torch.OutOfMemoryError): return True
    return isinstance(e, RuntimeError) and any(t in str(e) for t in _OOM_TEXTS)

def _slice(b, s:int, e:int):
    "Items `s:e` of a batch: tensors sliced along their first dimension, tuples and lists element by element"
    if isinstance(b, torch.Tensor): return b[s:e]
    if isinstance(b, (tuple, list)): return type(b)(_slice(o, s, e) for o in b)
    raise TypeError(f"GradientAccumulation(micro_bs=...) cannot split a batch element of type {type(b).__name__}: "
                    "only tensors and tuples/lists of them (give the loader micro-batches instead, with `n_step`)")

class MicroBatches:
    """The training loader with each of its batches cut into `ceil(n / ga.micro_bs)` near-equal micro-batches (none
    larger than `micro_bs`, none needlessly small: a BatchNorm layer cannot train on one item), read by fastai's loop in
    place of `learn.dl` during the training phase. Everything else is the real loader's (`bs`, `device`, `dataset`,
    ...). After an out-of-memory error `retry` makes it cut the same samples again, at the size in force then."""
    def __init__(self, dl, ga):
        self.dl,self.ga = dl,ga
        self.batch_index,self.batch_n,self.start,self.end,self.retry = -1,0,0,0,False
        self.decided = None   # the GradientAccumulation serial of the loader batch whose window action is decided
        self.last_chunk = self.last_batch = False
    def __getattr__(self, k):
        if k == 'dl': raise AttributeError(k)
        return getattr(self.dl, k)
    def _sizes(self)->list:
        "The loader's batch sizes, where it says (fastai's `n`, `bs`, `drop_last`), else `bs` each"
        n,bs,nb = getattr(self.dl, 'n', None),self.dl.bs,len(self.dl)
        if n is None or not bs: return [bs or 1]*nb
        return [min(bs, n - i*bs) for i in range(nb)]
    def __len__(self)->int:
        "Micro-batches this epoch at the size in force (an estimate for fastai's `n_iter` and progress bar)"
        m = self.ga.micro_bs
        return sum(-(-b//m) for b in self._sizes()) if m else len(self.dl)
    def __iter__(self):
        nb,bs = len(self.dl),self.dl.bs
        for bi,b in enumerate(self.dl):
            n = find_bs(b)
            self.batch_index,self.batch_n,self.start,self.last_batch = bi,n,0,bi == nb-1
            # The pieces left are counted on the items left; under DDP on the loader's batch size less `micro_bs` per
            # piece cut, so that a rank's short last batch is cut into as many pieces as the others' (fastai's
            # Recorder gathers every one)
            nom = bs if (self.ga._ddp() and bs) else None
            self.ga._loader_batch_started(n)
            while self.start < n:
                m,left = self.ga.micro_bs,n-self.start
                self.end = self.start + -(-left//max(1, -(-(left if nom is None else nom)//m)))
                self.last_chunk = self.end == n
                yield _slice(b, self.start, self.end) if (self.start, self.end) != (0, n) else b
                if self.retry: self.retry = False   # the same samples again, at the size in force now
                else: self.start,nom = self.end,(None if nom is None else max(nom - m, 1))
            self.ga._loader_batch_done(n)

# what an undone micro-batch puts back in the window; not the loader batch's decision (made once, at its first micro-batch)
_UNDO_FIELDS = tuple(k for k in Window.__slots__ if k not in ('n_units', 'unit_action', 'target'))

class _PeerOutOfMemory(Exception):
    "Another DDP rank ran out of memory in this micro-batch: this rank undoes it too, and every rank retries smaller"

class _RetryOneBatch:
    """`learn.one_batch` for `micro_bs='auto'`: a micro-batch that runs out of memory is undone and retried smaller.
    Under DDP the ranks agree after each micro-batch's backward (one all-reduce of a flag): if any rank ran out of
    memory, every rank undoes the micro-batch and all retry at the same smaller size, in step."""
    def __init__(self, learn, ga): self.learn,self.ga,self.orig = learn,ga,learn.one_batch
    def __call__(self, i, b):
        snap = self.ga._snapshot()
        try: return self.orig(i, b)
        except BaseException as e:   # validation batches are not cut: an error there is the user's to see
            peer = isinstance(e, _PeerOutOfMemory)
            if not ((peer or is_out_of_memory(e)) and self.learn.training and self.ga._split is not None): raise
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            e.__traceback__ = None   # its frames hold the attempt's tensors
        if not peer and self.ga._ddp(): self.ga._agree_on_oom(True)   # the ranks that fitted wait in `after_backward`
        self.ga._undo_micro(snap, msg)

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
        micro_bs:int|str|None=None, # cut every loader batch into micro-batches of this many items; 'auto': the fastest that fits
        probe:bool=True, # micro_bs='auto' on a GPU: once settled, time the next smaller size too and keep the faster
    ):
        if micro_bs is not None and not (micro_bs == 'auto' or (isinstance(micro_bs, Integral) and not isinstance(micro_bs, bool) and micro_bs >= 1)):
            raise ValueError(f"`micro_bs` must be a whole number >= 1, 'auto' or None, got {micro_bs!r}")
        if n_step is not None and target_bs is not None or (n_step is None and target_bs is None and micro_bs is None):
            raise ValueError("Give exactly one of `n_step` (micro-batches per optimizer step) or `target_bs` "
                             f"(items per optimizer step), or `micro_bs` alone (one step per loader batch); got "
                             f"n_step={n_step!r}, target_bs={target_bs!r}")
        if not isinstance(probe, bool): raise TypeError(f"`probe` must be True or False, got {probe!r}")
        if micro_bs is not None and n_step is None and target_bs is None: n_step = 1   # the window is the loader batch
        if not isinstance(partial, str) or partial not in PARTIAL_MODES:
            raise ValueError(f"`partial` must be one of {PARTIAL_MODES}, got {partial!r}")
        if n_items is not None and not callable(n_items):
            raise TypeError(f"`n_items` must be a function `f(learn) -> int` or None, got {type(n_items).__name__}")
        if not isinstance(skip_nonfinite, bool): raise TypeError(f"`skip_nonfinite` must be True or False, got {skip_nonfinite!r}")
        self.n_step_sched,self.target_bs_sched = as_window_schedule(n_step, 'n_step'),as_window_schedule(target_bs, 'target_bs')
        self.partial,self.n_items,self.skip_nonfinite = partial,n_items,skip_nonfinite
        self.micro_bs_mode,self.probe = micro_bs,probe
        # the micro-batch size in use: fixed, or what 'auto' found (kept for the next fit on this Learner)
        self.micro_bs = micro_bs if isinstance(micro_bs, Integral) else None
        self.micro_bs_trials = {}   # micro_bs='auto' on a GPU: images/s measured per size
        self._split,self._auto_snap,self._probe,self._serial,self._checked_sync_bn = None,None,None,0,False
        self._warned_divide,self._new_fit,self._listeners,self._undo_listeners = False,False,[],[]
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
        "Call `fn()` when `micro_bs='auto'` undoes a micro-batch that ran out of memory (before it is retried smaller)"
        if fn not in self._undo_listeners: self._undo_listeners.append(fn)
        return fn
    def remove_undo_listener(self, fn):
        if fn in self._undo_listeners: self._undo_listeners.remove(fn)

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
        add_fit_guard(self.learn, 'gradient_accumulation',   # KeyboardInterrupt, errors (the fit goes on after cancels)
                      lambda e: self._discard_window() or isinstance(e, CANCELS) or self._unhook_loop())
        if self.micro_bs_mode == 'auto':
            # the loader batch (its first batch's size for a loader of ready-made batches), or what an earlier fit found
            if self.micro_bs is None: self.micro_bs = getattr(self.dls.train, 'bs', None)
            # the probe's verdict stands for later fits (an out-of-memory error starts it again)
            self.learn.one_batch = _RetryOneBatch(self.learn, self)
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
        self._unhook_loop()
        remove_fit_guard(self.learn, 'gradient_accumulation')
        if not self._new_fit and self.n_skipped:   # trained in this fit and dropped windows
            warnings.warn(f"GradientAccumulation: {self.n_skipped} window(s) dropped because a micro-batch gave a "
                          "non-finite loss", stacklevel=2)

    def before_train(self):
        if self.micro_bs_mode is not None: self._split = self.learn.dl = MicroBatches(self.learn.dl, self)

    def after_train(self):
        if self._split is not None: self.learn.dl,self._split = self._split.dl,None
        self._end_micro()   # a callback before us may have cancelled the epoch in `after_batch`
        # Only an epoch cut short leaves a window open here (unless carrying it on): never let it leak
        if self.window.n_micro and not (self.partial == 'carry' and self.epoch < self.n_epoch-1): self._discard_window(drop=True)

    # -- batch --------------------------------------------------------------------------------------------------
    def before_batch(self):
        learn,w,sp = self.learn,self.window,self._split
        if self._new_fit: self._reset_logs(); self._new_fit = False
        self._end_micro()   # the last micro-batch's `after_batch` did not reach us (cancelled by a callback before us)
        bs = find_bs(learn.yb if len(learn.yb) else learn.xb)
        ddp = self._ddp()
        if sp is None:   # a micro-batch is a loader batch: decide at each
            if not w.n_micro: w.target = self.sched(learn.pct_train, learn.epoch)
            action = self._decide(bs, w.n_micro, w.n_samples, learn.iter == learn.n_iter-1, ddp)
        else:   # `micro_bs`: decide once per loader batch (a retried micro-batch keeps it); its last micro-batch acts
            if sp.decided != self._serial:
                if not w.n_units: w.target = self.sched(learn.pct_train, learn.epoch)
                w.unit_action = self._decide(sp.batch_n, w.n_units, w.n_samples, sp.last_batch, ddp)
                w.n_units += 1; sp.decided = self._serial
            action = w.unit_action if sp.last_chunk else None
        w.start_micro(bs, action)
        # DDP: only the micro-batch that steps all-reduces; the others accumulate locally. With micro_bs='auto' none
        # does: a rank may retry a micro-batch, so the gradients are all-reduced in `before_step`, after the ranks agree
        manual = self._ranks_retry()
        if action != 'step' or manual: w.no_sync = enter_no_sync(learn.model)
        if manual and not self._checked_sync_bn:
            if any(isinstance(m, torch.nn.SyncBatchNorm) for m in learn.model.modules()):
                raise ValueError("GradientAccumulation(micro_bs='auto') under DDP cannot retry a micro-batch through "
                                 "SyncBatchNorm (its forward waits for every rank): give `micro_bs` a number")
            self._checked_sync_bn = True

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
        n = self.n_items(learn) if self.n_items is not None else w.bs
        if isinstance(n, torch.Tensor): n = n.detach().float().squeeze()
        elif isinstance(n, bool) or not isinstance(n, (Integral, float)):
            raise TypeError(f"`n_items` must return an int or a 0-d tensor, got {type(n).__name__}")
        if not w.n_micro:
            # Hyper-parameters the schedule gives at the window's first micro-batch are the ones its step uses
            w.hypers = [dict(h) for h in learn.opt.hypers]
            # Loss scale reference: the backward loss keeps the size of one mean-reduced loss. Under DDP every rank
            # needs the same constant, so it is the loader's batch size there.
            w.ref = float(learn.dls.train.bs) if self._ddp() else (n.clamp(min=1.) if isinstance(n, torch.Tensor) else max(n, 1))
        w.n = n
        learn.loss_grad = learn.loss_grad * (n/w.ref)

    # Another callback cancelled the backward (before or after our `before_backward`): nothing of it counts
    def after_cancel_backward(self): self.window.n = None

    def after_backward(self):
        w = self.window
        if self._split is not None and self._ranks_retry() and self._agree_on_oom(False):
            raise _PeerOutOfMemory('another rank ran out of memory in this micro-batch')
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
        if self._ranks_retry(): self._sync_ranks(); world = 1
        else: world = world_size(self.learn.model)   # DDP averaged the gradients over the ranks
        scale = float(w.ref)*world/items
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

    def after_batch(self):
        self._end_micro()
        sp = self._split
        if sp is not None and sp.batch_n:   # progress by loader batches, as without `micro_bs` (schedules see the same)
            learn = self.learn
            learn.pct_train = (learn.epoch + (sp.batch_index + sp.end/sp.batch_n)/len(sp.dl))/learn.n_epoch

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

    # -- micro_bs='auto' -----------------------------------------------------------------------------------------
    def _unhook_loop(self):
        if isinstance(self.learn.__dict__.get('one_batch'), _RetryOneBatch): del self.learn.__dict__['one_batch']
        if self._split is not None: self.learn.dl,self._split = self._split.dl,None
        self._auto_snap = None

    def _state_tensors(self):
        "(BatchNorm buffers and their snapshot copies, Batch Renorm layers, parameters), gathered once per fit"
        if self._auto_snap is None:
            model = self.learn.model
            bufs = [t for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                    for t in (m.running_mean, m.running_var, m.num_batches_tracked) if t is not None]
            renorms = [m for m in model.modules() if hasattr(m, 'renorm_steps')]
            params = [p for p,*_ in self.learn.opt.all_params()] if getattr(self.learn, 'opt', None) else list(model.parameters())
            self._auto_snap = dict(bufs=bufs, buf_copy=[t.clone() for t in bufs], renorms=renorms, params=params, grad_copy=None)
        return self._auto_snap

    def _snapshot(self)->dict:
        "What a micro-batch can change before its backward ends, kept to undo it (no host synchronisation)"
        st,w = self._state_tensors(),self.window
        dev = next(iter(st['params']), torch.empty(0)).device
        snap = dict(rng=torch.get_rng_state(), py=random.getstate(), dev=dev,
                    cuda=torch.cuda.get_rng_state(dev) if dev.type == 'cuda' else None,
                    window={k: getattr(w, k) for k in _UNDO_FIELDS}, renorm=[m.renorm_steps for m in st['renorms']],
                    autocast=torch.is_autocast_enabled(dev.type) if dev.type in ('cuda', 'cpu') else False,
                    grads=bool(w.n_micro))
        if st['bufs']: torch._foreach_copy_(st['buf_copy'], st['bufs'])
        if w.n_micro:   # an open window: its accumulated gradient (else the gradients are zero)
            ps = [p for p in st['params'] if p.grad is not None]
            if st['grad_copy'] is None or len(st['grad_copy'][0]) != len(ps) or any(a is not b for a,b in zip(st['grad_copy'][0], ps)):
                st['grad_copy'] = (ps, [torch.empty_like(p.grad) for p in ps])
            if ps: torch._foreach_copy_(st['grad_copy'][1], [p.grad for p in ps])
        return snap

    def _undo_micro(self, snap:dict, msg:str):
        "A micro-batch ran out of memory: undo everything it touched, halve `micro_bs`, and have the same samples cut again"
        learn,w,st = self.learn,self.window,self._auto_snap
        learn.pred = learn.loss = learn.loss_grad = None   # the attempt's tensors
        dev = snap['dev']
        if dev.type in ('cuda', 'cpu') and torch.is_autocast_enabled(dev.type) and not snap['autocast']:
            for cb in learn.cbs:   # MixedPrecision enters autocast in `before_batch` and leaves it in `after_loss`
                if isinstance(cb, MixedPrecision) and getattr(cb, 'autocast', None) is not None: cb.autocast.__exit__(None, None, None)
        self._exit_no_sync(); self._put_back_hypers()
        for f in list(self._undo_listeners): f()
        gc.collect()
        if dev.type == 'cuda': torch.cuda.empty_cache()
        torch.set_rng_state(snap['rng']); random.setstate(snap['py'])
        if snap['cuda'] is not None: torch.cuda.set_rng_state(snap['cuda'], dev)
        if st['bufs']: torch._foreach_copy_(st['bufs'], st['buf_copy'])
        for m,v in zip(st['renorms'], snap['renorm']): m.renorm_steps = v
        if snap['grads'] and st['grad_copy'] is not None:
            ps,copy = st['grad_copy']
            torch._foreach_copy_([p.grad for p in ps], copy)
            kept = set(map(id, ps))
            for p in st['params']:
                if p.grad is not None and id(p) not in kept: p.grad.zero_()
        else:
            for p in st['params']:
                if p.grad is not None: p.grad.zero_()
        for k,v in snap['window'].items(): setattr(w, k, v)
        size = self.micro_bs
        if size <= 1:
            raise RuntimeError(f"GradientAccumulation(micro_bs='auto'): out of memory with a micro-batch of 1 item ({msg}). "
                               "The model does not fit this device at any micro-batch: free memory, use mixed precision, "
                               "a smaller model or smaller inputs") from None
        self.micro_bs,self._probe = size//2,None
        sp = self._split
        sp.retry = True
        warnings.warn(f"GradientAccumulation: out of memory with micro-batch {size} ({msg}); micro_bs is now {size//2}, "
                      "and the same samples run again", stacklevel=2)

    def _probe_here(self)->bool: "Time sizes only on a GPU (the size matters there)"; return next(self.learn.model.parameters()).is_cuda
    def _clock(self)->float:
        "Seconds, once the GPU has finished what was queued"
        if torch.cuda.is_available() and next(self.learn.model.parameters()).is_cuda: torch.cuda.synchronize()
        return time.perf_counter()

    def _loader_batch_started(self, n:int):
        self._serial += 1
        if self.micro_bs is None: self.micro_bs = n
        p = self._probe
        if p is not None and p['stage'] in ('time_a', 'time_b'): p['t0'] = self._clock()

    def _loader_batch_done(self, n:int):
        "micro_bs='auto' on a GPU, outside DDP: once a size has run a loader batch, time it and the next smaller; keep the faster"
        if not (self.micro_bs_mode == 'auto' and self.probe) or self._ddp(): return
        if not self._probe_here(): return
        p = self._probe
        if p is None: self._probe = dict(stage='time_a' if self.micro_bs >= 2 else 'done', size=self.micro_bs); return
        if p['stage'] == 'time_a':
            p['rate_a'] = n/(self._clock()-p['t0'])
            self.micro_bs_trials[p['size']] = p['rate_a']
            self.micro_bs,p['stage'] = p['size']//2,'warm_b'
        elif p['stage'] == 'warm_b': p['stage'] = 'time_b'   # cuDNN picks its algorithms for the new shapes first
        elif p['stage'] == 'time_b':
            rate = n/(self._clock()-p['t0'])
            small = p['size']//2
            self.micro_bs_trials[small] = rate
            self.micro_bs = small if rate > p['rate_a'] else p['size']
            p['stage'] = 'done'
            if self.micro_bs == small:
                warnings.warn(f"GradientAccumulation: micro-batch {small} ran at {rate:.0f} items/s against {p['size']}'s "
                              f"{p['rate_a']:.0f}: micro_bs is now {small}", stacklevel=2)

    def _ddp(self)->bool: return _is_ddp(self.learn.model)
    def _ranks_retry(self)->bool: "micro_bs='auto' under DDP: the ranks agree on every retry"; return self.micro_bs_mode == 'auto' and self._ddp()

    def _agree_on_oom(self, mine:bool)->bool:
        "micro_bs='auto' under DDP, after every micro-batch: did any rank run out of memory? (one small all-reduce)"
        return sum_over_ranks([float(mine)], self.learn.model)[0] > 0

    def _sync_ranks(self):
        """micro_bs='auto' under DDP: the gradients all-reduced here (every micro-batch ran under no_sync). The ranks'
        micro_bs need no agreeing: they start alike, halve together and do not probe"""
        import torch.distributed as dist
        params = [p for p,*_ in self.learn.opt.all_params()]
        for p in params:
            if p.grad is None: p.grad = torch.zeros_like(p)   # a parameter unused on this rank: its rows count as zero
        by_dtype = {}
        for p in params: by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for gs in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(gs)
            dist.all_reduce(flat)
            torch._foreach_copy_(gs, list(torch._utils._unflatten_dense_tensors(flat, gs)))

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
