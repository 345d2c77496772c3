"""Exact gradient accumulation for fastai: every optimizer step gets the gradient one large batch of the same samples
gives"""
from __future__ import annotations

import torch, torch.nn as nn
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import patch

from ..core.distributed import SyncPolicy, check_fsdp, is_distributed, sum_over_ranks
from ..compat.torch import BatchNormBase
from ..core.protocols import (Listeners, ResumeSignature, SaysPickled, WindowOwner, add_fit_guard, in_inference,
                               one_per_learner, refuse_accumulation_conflicts, refuse_at_fit_start, remove_fit_guard,
                               RunningStatsPolicy)
from ..core.losses import check_n_items, count_dtype, loss_reduction, micro_items
from ..micro import MicroBatching, micro_batching
from ..core.loaders import ReadAhead
from ..micro.loader import CutLoader
from .advice import warn_at_fit_start, warn_counting
from .plan import Padding, WindowPlan
from .schedule import PARTIAL_MODES
from ..core.args import flag
from .state import Phase, Window
from .log import WindowLog
from .lr_find import WindowedLRFinder, lr_finder

__all__ = ['GradientAccumulation', 'PARTIAL_MODES']

@one_per_learner("(`learn.accumulate(...)` replaces the one there; `fit(cbs=...)` and `add_cb` add another.)")
class GradientAccumulation(SaysPickled, Callback, WindowOwner, ResumeSignature, WindowLog):
    """Accumulate gradients over micro-batches; each optimizer step applies exactly the mean gradient of its window.
    An adapter from fastai's events to the window (`state.Window`: the rule), its plan (`plan.WindowPlan`: size, clock,
    learning-rate gain), the ranks' sync (`core.distributed.SyncPolicy`) and its log (`log.WindowLog`)"""
    # Before `MixedPrecision` (10) and `GradientClip` (11) in `before_step`: the scaler unscales, checks and updates,
    # and clipping clips, once per window and on the finished window gradient. `_only_train_loop`: `learn.summary()`
    # runs its forward without us.
    order,run_valid,_only_train_loop = MixedPrecision.order-4,False,True

    def __init__(self,
        *args, # refused: name the window (`n_step=` counts micro-batches; fastai's positional count is samples)
        # micro-batches per optimizer step (or an `{epoch: n}` mapping / function of progress)
        n_step:int|dict|callable=None,
        # items per optimizer step: a window closes at the first micro-batch reaching it
        target_bs:int|dict|callable=None,
        partial:str=None, # partial window at the end of an epoch: 'step' it (default), 'drop' it, or 'carry' it on
        n_items:callable=None, # `f(learn)` -> items the micro-batch's mean loss averages over (default: the batch size)
        skip_nonfinite:bool=True, # drop a window in which any micro-batch gave a non-finite loss
        global_window:bool=False, # `target_bs` counts the samples of all ranks: the same windows on any number of them
    ):
        if args: raise TypeError(f"GradientAccumulation({', '.join(map(repr, args))}): name the window: "
                                 f"`n_step=` (micro-batches a step) or `target_bs=` (items a step)")
        if n_step is None and target_bs is None:
            raise TypeError("GradientAccumulation needs its window: `n_step=` (micro-batches a step) or `target_bs=` "
                            "(items); `cbs=GradientAccumulation`, the class, gives none: `GradientAccumulation(n_step=8)`")
        self.plan = WindowPlan(n_step, target_bs, partial, global_window=global_window)
        self.n_items,self.skip_nonfinite = check_n_items(n_items),flag(skip_nonfinite, 'skip_nonfinite')
        self.sync = SyncPolicy()
        self.mb,self._joined,self._bn_hooks,self._new_fit,self.window_listeners = None,[],[],False,Listeners()
        self.said = set()   # what `advice` has said at fit start (once each: 'window', 'layers', 'fsdp')
        # the loader read ahead; the open window; padding
        self._ahead,self.window,self.padding = None,Window(),Padding()
        self.reset_logs()

    def __repr__(self):
        "The callback and its window: `GradientAccumulation(n_step=8): 4 x 8 = 32 per step` once on a Learner"
        return f"{type(self).__name__}({repr(self.plan.sched).partition('(')[2][:-1]}): {self.window_text()}"

    def window_text(self)->str: "The window in words: `4 x 8 = 32 per step`"; return describe_window(self)

    resume_keys = ('window',)
    def resume_signature(self)->dict:
        "A resume must cut the same windows"; return {'window': f"{self.plan.sched!r}, partial={self.plan.partial!r}"}

    @property
    def window_n_step(self)->int:
        "Micro-batches a full window takes now (for `target_bs`: at the training loader's batch size)"
        return self.plan.micro_batches(self.window, self.dls.train.bs, micro_batching(self.learn))

    # -- a checkpoint between micro-batches (`resume.checkpoint`) --------------------------------------------
    def state_dict(self)->dict:
        "What the rest of the fit needs of this callback: the window in progress, the logs, the schedule's clock"
        return dict(window=self.window.state_dict(), logs=self.logs_state(), **self.plan.state_dict())
    def load_state_dict(self, sd:dict):
        self.window.load_state_dict(sd['window']); self.load_logs(sd['logs']); self.plan.load_state_dict(sd)
        self._new_fit = False   # (the logs are this fit's)

    # -- fit ----------------------------------------------------------------------------------------------------
    def before_fit(self):
        # fastai sends `before_fit`/`after_fit` around `validate`, `get_preds`, `predict` and `tta` too, holding the
        # Learner's lock: nothing to do there, and a raise would leave the lock held (every later validate hangs)
        if in_inference(self.learn): return
        self.sync.fit_starts(self.learn)
        refuse_at_fit_start(self.learn)   # every refusal of ours, before anything is set up
        # the logs of the last fit are reset at its first training batch: they survive a `validate()`
        self._new_fit = True
        self.window.reset(); self.window.start_micro()
        self._zero_grads()      # nothing left by an earlier fit (or by hand) leaks into the first window
        add_fit_guard(self.learn, 'gradient_accumulation', lambda e: self._unhook())   # errors, KeyboardInterrupt
        self.mb,self.plan.clock = micro_batching(self.learn),type(self.plan.clock)()
        # the loader's real end: read ahead (after any callback that replaces the loader); `MicroBatching` does it
        # itself
        if self.mb is None: self.learn.add_cb(CutLoader(self))
        warn_at_fit_start(self, getattr(self.dls.train, 'bs', None))
        # BatchNorm's check: hooked at the fit's first micro-batch of 1 item, on to the fit's end
        self._bn_hooks = None
        if (f := lr_finder(self.learn)) is not None:   # `lr_find`: a rate a step (joined now: its `before_fit` by hand)
            self.learn.add_cb(w := WindowedLRFinder(self, f)); self._joined.append(w); w.before_fit()

    def refuse_fit(self):
        "What this fit is refused for (`protocols.refuse_at_fit_start`)"
        refuse_accumulation_conflicts(self.learn)
        self.plan.check_ranks(self.learn, cut=micro_batching(self.learn) is not None)
        refuse_unreduced_loss(self.learn.loss_func)

    def after_fit(self):
        if in_inference(self.learn): return
        self._end_micro(); self._unhook()
        self.mb = None
        remove_fit_guard(self.learn, 'gradient_accumulation')
        if not self._new_fit: self.warn_skipped()   # (trained in this fit)

    # a model another callback sharded in its `before_fit` (Accelerate's FSDP plugin)
    def before_train(self): check_fsdp(self.learn.model)
    def start_train(self):
        """(`CutLoader`, once the loader is final) Read the training loader ahead: the window ends where the loader
        really ends"""
        self._ahead = self.learn.dl = ReadAhead(self.plan.loader(self.learn.dl, self.learn.model))

    def _remove_bn_hooks(self): [h.remove() for h in self._bn_hooks or []]; self._bn_hooks = []

    def _unhook(self):
        """The fit is over (or left by an exception): the window discarded, the loader and the callback list as before
        the fit"""
        self._remove_bn_hooks()
        self._discard_window()
        learn = self.learn
        if learn is None: return
        if self._ahead is not None: learn.dl,self._ahead = self._ahead.dl,None
        for cb in self._joined: cb.finish()
        learn.remove_cbs(self._joined); self._joined = []   # joined for the fit: they leave with it
        learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, CutLoader) and cb.mb is self])

    def after_train(self):
        if self._ahead is not None: self.learn.dl,self._ahead = self._ahead.dl,None
        self.sync.train_ends(self.learn.model)
        self._end_micro()   # a callback before us may have cancelled the epoch in `after_batch`
        # Only an epoch cut short leaves a window open here (unless carrying it on): never let it leak
        if self.window.n_micro and not (self.plan.partial == 'carry' and self.epoch < self.n_epoch-1): self._discard_window(drop=True)

    # -- batch --------------------------------------------------------------------------------------------------
    def before_batch(self):
        learn,w,plan = self.learn,self.window,self.plan
        p = self.mb.piece if self.mb is not None else None   # `micro_bs`: the piece of a loader batch being run
        if self._new_fit: self.reset_logs(); self._new_fit = False
        self._end_micro()   # the last micro-batch's `after_batch` did not reach us (cancelled by a callback before us)
        bs,ddp = find_bs(learn.yb if len(learn.yb) else learn.xb),is_distributed(learn.model)
        # (a micro-batch of 2 costs nothing)
        if bs < 2 and self._bn_hooks is None: self._bn_hooks = one_value_hooks(learn)
        if plan.clock.epoch != learn.epoch:   # the clock counts the epoch's windows over the loader's real batches
            real = self.mb.loader.dl if self.mb is not None and self.mb.loader is not None else (self._ahead.dl if self._ahead is not None else learn.dl)
            plan.start_epoch(learn, real, w.n_units if self.mb is not None else w.n_micro, w.n_samples, ddp)
        last = self._ahead.last if self._ahead is not None else learn.iter == learn.n_iter-1
        action = plan.next_unit(learn, w, p, last, bs, ddp, self.padding)
        w.start_micro(bs, action)
        w.no_sync = self.sync.micro_starts(learn.model, action, self._ranks_retry())

    def before_backward(self):
        learn,w = self.learn,self.window
        # the count the micro-batch's loss averages over
        n = 0 if self.padding.on else micro_items(learn, self.n_items, w.bs)
        if 'count' not in self.said: warn_counting(self)
        # the window's first micro-batch: its reference (under DDP the loader's batch size, the same on every rank), the
        # loss's kind, and the hyper-parameters the schedule gives now, which its step uses
        if not w.n_micro: w.begin(n, loss_reduction(learn.loss_func) == 'sum', learn.dls.train.bs if is_distributed(learn.model) else None,
                                  [dict(h) for h in learn.opt.hypers])
        w.pending = n
        if not w.summed: learn.loss_grad = learn.loss_grad * w.loss_weight(n)

    # Another callback cancelled the backward (before or after our `before_backward`): nothing of it counts
    def after_cancel_backward(self): self.window.pending = None

    def after_backward(self):
        w = self.window
        w.exit_no_sync()
        if w.pending is None: return
        loss = self.learn.loss.detach()
        w.add(w.pending, 0 if self.padding.on else w.bs, loss.to(count_dtype(loss)))

    def before_step(self):
        learn,w,opt = self.learn,self.window,self.learn.opt
        # Not the end of a window: skip `opt.step()` *and* `opt.zero_grad()` (CancelStepException would zero them)
        if w.action is None: raise CancelBatchException()
        # Dropped or skipped windows cancel the whole batch, so `after_step` (e.g. the grad scaler's `update`, which
        # needs a `step` first) does not run; their gradients are zeroed here.
        if not w.n_micro: self._close(False); raise CancelBatchException()   # every backward was cancelled
        items,loss_sum = sum_over_ranks([w.items, w.loss_sum], learn.model)   # the one host synchronisation a window
        verdict = w.verdict(items, loss_sum, self.skip_nonfinite)
        if verdict != 'step':
            if verdict == 'drop': self.n_dropped += 1
            else: self.n_skipped += 1
            self._close(False); raise CancelBatchException()
        w.scale_grads([p.grad for p,*_ in opt.all_params(with_grad=True)], items, self.sync.reduce(learn.model, opt, self._ranks_retry()))
        w.hypers = self.plan.step_hypers(w, self.mb is not None, learn.dls.train.bs if is_distributed(learn.model) else None, opt)
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
        if w.stepped: self.log_step(w.record)
        else: self.n_step_cancelled += 1
        self._close(w.stepped, zero=False)   # the loop zeroes the gradients right after `after_step`

    def after_batch(self): self._end_micro()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _end_micro(self):
        """Finish the micro-batch: leave no_sync, put hyper-parameters back, and drop a window whose step was cancelled
        after its backward"""
        w = self.window
        w.exit_no_sync(); w.put_back_hypers(self.learn.opt); self.padding.end()
        if w.action is not None and not w.closed and (w.counted or w.record is not None):
            self.n_step_cancelled += 1; self._close(False)
        w.end_micro()

    def _close(self, stepped:bool, zero:bool=True):
        "The window is over: stepped, or not (its gradients zeroed); tell the listeners"
        if not stepped and zero: self._zero_grads()
        self.window.close()
        self.window_listeners(stepped)

    def _zero_grads(self): self.sync.zero(self.learn.model, getattr(self.learn, 'opt', None))

    def _discard_window(self, drop=False):
        "Zero the gradients of an open window and forget it"
        w = self.window
        w.exit_no_sync(); w.put_back_hypers(getattr(self.learn, 'opt', None)); self.padding.end()
        if drop and w.n_micro: self.n_dropped += 1
        self._zero_grads()
        if w.n_micro: self._close(False, zero=False)
        else: w.reset()

    def _ranks_retry(self)->bool: "MicroBatching('auto') under DDP: the ranks agree on every retry"; return self.mb is not None and self.mb.manual_sync

def describe_window(ga)->str:
    "The window in words: micro-batch size x micro-batches = items per optimizer step (at the training loader's `bs`)"
    sc,dls = ga.plan.sched,getattr(ga.learn, 'dls', None) if ga.learn is not None else None
    bs = getattr(getattr(dls, 'train', None), 'bs', None)
    if sc.constant is None: return 'a window that changes over the fit (a schedule)'
    if not bs: return f"{sc.constant} {'items' if ga.plan.by_items else 'micro-batches'} per optimizer step"
    mb = micro_batching(ga.learn)
    k = ga.plan.micro_batches(ga.window, bs, None)
    cut = mb.size if mb is not None and mb.size and not mb.auto and mb.size < bs else None
    if cut: return f"{bs} x {k} = {bs*k} per step (each loader batch of {bs} in {mb.pieces(bs)} micro-batches of {cut})"
    return f"{bs} x {k} = {bs*k} per step"

def refuse_unreduced_loss(loss_func):
    "A loss with `reduction='none'` gives one loss per item: fastai's backward needs one number (the mean, or a sum)"
    # (fastai's `CrossEntropyLossFlat` and other `BaseLoss` hold torch's loss there)
    f = getattr(loss_func, 'func', loss_func)
    if getattr(loss_func, 'reduction', None) == 'none' or (isinstance(f, nn.Module)
                                                           and getattr(f, 'reduction', None) == 'none'):
        raise ValueError(f"loss_func {type(loss_func).__name__}(reduction='none') gives a loss per item, and fastai's "
                         "backward needs one number: give the Learner the default reduction='mean' (e.g. "
                         "nn.CrossEntropyLoss()), or reduce it yourself: loss_func=lambda out, *y: "
                         "loss(out, *y).mean()")

def one_value_hooks(learn)->list:
    """Forward pre-hooks on the model's BatchNorm layers, put on at the fit's first micro-batch of 1 item and kept to
    the fit's end: a layer in training mode given one value per channel is refused naming the fix, before torch raises
    deep in the forward (a layer in eval mode, in validation or frozen, is not checked)"""
    def check(name):
        def hook(m, args):
            x = args[0] if args else None
            if m.training and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() == x.shape[1]:
                # (a head's BatchNorm1d on (N, C) as GroupNorm would output its bias only: frozen instead)
                fix = "'freeze'" if x.dim() == 2 else "'groupnorm') (or 'freeze'"
                src,more = one_item_source(learn)
                raise ValueError(f"BatchNorm layer {name!r} gets 1 value per channel: a micro-batch of 1 item ({src}) "
                                 f"cannot be normalised. Give cbs=BatchNormAccumulation({fix}), or micro-batches of 2 "
                                 f"or more items ({more})")
        return hook
    if any(isinstance(cb, RunningStatsPolicy) and cb.window_normalises() for cb in learn.cbs): return []
    bns = [(n, m) for n,m in learn.model.named_modules() if isinstance(m, BatchNormBase)]
    return [m.register_forward_pre_hook(check(n)) for n,m in bns]

def one_item_source(learn)->tuple[str,str]:
    "Where a micro-batch of 1 item comes from (the loader's `bs`, its last batch, `MicroBatching`'s cut), and its fix"
    mb,bs = micro_batching(learn),getattr(learn.dls.train, 'bs', None)
    if bs == 1: return "the loader's bs=1","the loader's bs=2 or more"
    if mb is not None and mb.piece is not None and mb.piece.batch_n > 1:
        cut = f"{mb!r} cut a loader batch of {mb.piece.batch_n} items into pieces of 1"
        return cut,"MicroBatching(2) or more: micro_bs=2"
    return (f"the epoch's last batch: the loader's bs={bs} with drop_last=False leaves 1 item",
            "the training loader's drop_last=True, or a bs that leaves 2 or more")

@patch
def accumulate(self:Learner,
    n_step:int|dict|callable=None, # micro-batches per optimizer step (loader batches where `micro_bs` cuts them)
    n_acc:int|float=None, # fastai's spelling: items per optimizer step, `target_bs` with windows carried over epochs
    # cut every loader batch into micro-batches of this many items ('auto': the largest that fits)
    micro_bs:int|str=None,
    **kwargs # `target_bs`, `partial`, `n_items`, `skip_nonfinite`, `global_window`: see `GradientAccumulation`
):
    """Accumulate gradients exactly over micro-batches: replaces any accumulation callback already there (ours or
    fastai's), and with `micro_bs` any `MicroBatching`. `micro_bs` adds a `MicroBatching(micro_bs)`, one step per loader
    batch unless a window is given. A recipe that imports `fastai.vision.all` after `accum_callback` gets fastai's
    `GradientAccumulation` back under that name; `learn.accumulate(n_acc=64)` stays ours whatever was imported after"""
    if n_acc is not None:
        if 'target_bs' in kwargs: raise TypeError("learn.accumulate: give `target_bs` or fastai's `n_acc`, not both")
        if isinstance(n_acc, float) and n_acc.is_integer(): n_acc = int(n_acc)
        kwargs = dict(kwargs, target_bs=n_acc, partial=kwargs.get('partial') or 'carry')
    if micro_bs is not None and n_step is None and 'target_bs' not in kwargs: n_step = 1   # the window: a loader batch
    cbs = [GradientAccumulation(n_step=n_step, **kwargs)]   # validate before touching the Learner
    if micro_bs is not None: cbs.append(MicroBatching(micro_bs))
    old = (GradientAccumulation, FastaiGradientAccumulation) + ((MicroBatching,) if micro_bs is not None else ())
    self.remove_cbs([c for c in self.cbs if isinstance(c, old)])
    return self.add_cbs(cbs)
