"""`MicroBatching`: the training loader's batches cut into micro-batches of a fixed size or of the largest that fits
('auto': an out-of-memory micro-batch is undone and run again at half the size), inference batches cut when they run
out of memory, and the per-row state of models that carry it. `GradientAccumulation` counts its `n_step` in loader
batches of them (`learn.accumulate(micro_bs=...)` adds both); what it reads of the piece being run is `piece`
(`loader.Piece`)."""
from __future__ import annotations
import time, warnings
from numbers import Integral

import torch
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.fp16 import MixedPrecision

from ..core.distributed import is_ddp, is_distributed, is_fsdp, sum_over_ranks
from ..core.protocols import (CANCELS, Listeners, ResumeSignature, SaysPickled, add_fit_guard, in_inference,
                              one_per_learner, refuse_at_fit_start, remove_fit_guard, user_stacklevel, window_owner)
from ..core.args import NotWholeNumber, flag, whole_number
from .inference import InferenceCutter
from .loader import CutLoader, MicroBatches
from .pieces import first_line, halved, is_out_of_memory, n_pieces
from .retry import PeerOutOfMemory, Snapshot
from .state import RowStates, refuse_stateful, stateful_modules

__all__ = ['MicroBatching', 'check_micro_bs', 'micro_batching', 'micro_size']

def check_micro_bs(micro_bs, name:str='micro_bs'):
    "`micro_bs` as a whole number >= 1 or 'auto', or a `NotWholeNumber` error (a ValueError and a TypeError) naming it"
    if isinstance(micro_bs, str) and micro_bs == 'auto': return micro_bs
    try: return whole_number(micro_bs, name)
    except NotWholeNumber:
        raise NotWholeNumber(f"`{name}` must be a whole number >= 1 or 'auto', got {micro_bs!r}") from None

@one_per_learner("(`learn.accumulate(micro_bs=...)` replaces the one there.)")
class MicroBatching(SaysPickled, Callback, ResumeSignature):
    """Cut every training batch into near-equal micro-batches of at most `size` items, or under `'auto'` of the largest
    size that fits (the loader's batch first, halved after each out-of-memory error, the same samples run again; on a
    GPU the next smaller size is timed once and the faster kept). Under 'auto' an inference batch whose forward or loss
    runs out of memory is cut too. A model that carries state from one batch to the next runs each piece from its own
    rows of it. Needs a `GradientAccumulation` beside it, whose `n_step` counts loader batches
    (`learn.accumulate(micro_bs=...)` adds both).

    `size`: the micro-batch in force (fixed, or what 'auto' found, kept for the next fit); `inference_bs`: the largest
    inference piece that fitted (None: not cut); `trials`: items/s the probe measured per size; `piece`: the piece being
    run (`loader.Piece`, None outside a cut training loader)."""
    # before GradientAccumulation (order-4): the ranks agree before it counts
    order,run_valid = MixedPrecision.order-5,True
    # `learn.summary()` takes the `_only_train_loop` callbacks off for its pass (`GradientAccumulation` too): this one
    # goes with it (left on alone, it was an orphan that left the Learner for good)
    _only_train_loop = True

    def __init__(self,
        size:int|str='auto', # items a micro-batch, or 'auto': the fastest that fits
        probe:bool=True, # 'auto' on a GPU: once settled, time the next smaller size too and keep the faster
    ):
        self.mode = check_micro_bs(size, 'size')
        self.probe_on,self.size = flag(probe, 'probe'),(self.mode if isinstance(self.mode, Integral) else None)
        self.trials,self.loader,self.rows,self.inference,self.snapshot = {},None,RowStates([]),InferenceCutter(),None
        self._probe,self._serial,self._sync_bn_checked,self.agreed,self._listeners = None,0,False,False,Listeners()

    def __repr__(self):
        "`MicroBatching(4)`, or `MicroBatching('auto')` with the size it has settled on"
        now = f": {self.size} items a micro-batch now" if self.auto and self.size else ''
        return f"{type(self).__name__}({self.mode!r}){now}"

    resume_keys = ('micro_bs',)
    def resume_signature(self)->dict: "A resume must cut as this fit does"; return {'micro_bs': self.mode}
    @property
    def auto(self)->bool: return self.mode == 'auto'
    @property
    def inference_bs(self)->int|None: return self.inference.size
    @property
    def piece(self):
        "The piece being run (`Piece`), or None"; return self.loader.piece if self.loader is not None else None
    @property
    def manual_sync(self)->bool:
        """'auto' under DDP: a rank may retry a micro-batch, so none all-reduces in its backward; the window all-reduces
        at its step"""
        return self.auto and is_ddp(self.learn.model)
    def pieces(self, n:int)->int:
        "Micro-batches a loader batch of `n` items is cut into at the size in force"; return n_pieces(n, self.size or n)
    def on_undo(self, fn):
        "Call `fn()` when a micro-batch is undone (out of memory, or cancelled on another DDP rank)"
        return self._listeners.add(fn)
    def remove_undo_listener(self, fn): self._listeners.discard(fn)

    # -- fit ---------------------------------------------------------------------------------------------------------
    def before_fit(self):
        learn = self.learn
        if in_inference(learn):   # `validate`, `get_preds`, `predict`, `tta`: cut a batch that runs out of memory
            self.inference.learn = learn
            return
        refuse_at_fit_start(learn)   # the first of ours in a fit: every refusal of ours before anything is set up
        ga = self._window()
        self.rows.unwatch()
        self.rows = RowStates(stateful_modules(learn.model)[0])
        self.rows.watch()   # a reset while a batch is cut is respected
        self.inference.learn,self.inference.rows = learn,self.rows
        self.snapshot = Snapshot(learn, ga.window_state, ga.restore_window)
        self.snapshot.listeners = self._listeners
        self._sync_bn_checked = False
        if self.auto:
            if self.size is None: self.size = getattr(learn.dls.train, 'bs', None)   # or what an earlier fit found
            self._wrap_one_batch()
        if not any(isinstance(cb, CutLoader) for cb in learn.cbs): learn.add_cb(CutLoader(self))
        add_fit_guard(learn, 'micro_batching', lambda e: isinstance(e, CANCELS) or self._unhook())

    def state_dict(self)->dict:
        "The size in force and what 'auto' learned (a checkpoint)"
        return dict(size=self.size, trials=self.trials, probe=self._probe, serial=self._serial)
    def load_state_dict(self, sd:dict):
        self.size,self.trials,self._probe,self._serial = sd['size'],sd['trials'],sd['probe'],sd['serial']

    def _window(self):
        """The `GradientAccumulation` that steps once per loader batch (found by its declared interface,
        `protocols.WindowOwner`)"""
        return window_owner(self.learn)

    def refuse_fit(self):
        """What this fit is refused for (`protocols.refuse_at_fit_start`): no window to step, 'auto' under FSDP2, a
        stateful model we cannot cut"""
        if self._window() is None:
            raise ValueError("MicroBatching cuts each loader batch into micro-batches and needs "
                             "`accum_callback.GradientAccumulation(n_step=1)` (one step a loader batch) beside it, "
                             "or `learn.accumulate(micro_bs=...)`, which adds both")
        model = self.learn.model
        if self.auto and is_fsdp(model):
            raise ValueError("MicroBatching('auto') under FSDP2: a rank that runs out of memory in the "
                             "middle of a forward or backward leaves the others waiting in FSDP's all-gathers and "
                             "reduce-scatters, so it cannot be undone and retried. Give `MicroBatching` a number "
                             "(every rank cuts its batches into the same number of pieces)")
        bad = stateful_modules(model)[1]
        if bad: refuse_stateful(bad, model)

    def after_fit(self):
        if in_inference(self.learn): return self._unwrap_one_batch()   # (also after an error)
        self._unhook()
        remove_fit_guard(self.learn, 'micro_batching')

    def before_train(self): pass   # (the loader is cut by `CutLoader`, after the callbacks that replace it)
    def start_train(self): self.loader = self.learn.dl = MicroBatches(self.learn.dl, self)
    def after_train(self):
        if self.loader is not None: self.learn.dl,self.loader = self.loader.dl,None
        if self.rows: self.rows.n = None

    def before_validate(self):
        if self.auto and in_inference(self.learn): self._wrap_one_batch()
    def after_validate(self):
        if self.auto and in_inference(self.learn): self._unwrap_one_batch()

    def _wrap_one_batch(self):
        if not isinstance(self.learn.__dict__.get('one_batch'), _OneBatch):
            self.learn.one_batch = _OneBatch(self.learn, self)
    def _unwrap_one_batch(self):
        if self.learn is not None and isinstance(self.learn.__dict__.get('one_batch'), _OneBatch):
            del self.learn.__dict__['one_batch']
    def _unhook(self):
        "The fit is over (or left by an exception): `learn.one_batch` and `learn.dl` are fastai's again"
        learn = self.learn
        if learn is None: return
        self._unwrap_one_batch()
        self.after_train()
        learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, CutLoader)])
        self.rows.unwatch()
        if self.snapshot is not None: self.snapshot._state = self.snapshot.snap = None

    # -- per micro-batch ---------------------------------------------------------------------------------------------
    def before_batch(self):
        if self.loader is None: return
        if self.manual_sync and not self._sync_bn_checked:   # (DDP wraps the model in its own before_fit: checked here)
            if any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.learn.model.modules()):
                raise ValueError("MicroBatching('auto') under DDP cannot retry a micro-batch through "
                                 "SyncBatchNorm (its forward waits for every rank): give `MicroBatching` a number")
            self._sync_bn_checked = True
        p = self.loader.piece
        # the micro-batch's rows of a stateful model's state
        if self.rows.n is not None: self.rows.enter(p.start, p.end)
    def after_pred(self):
        p = self.piece
        if p is not None and self.rows.n is not None: self.rows.leave(p.start, p.end)

    def after_backward(self):
        """Under 'auto' + DDP every rank comes here or to `after_cancel_batch` once per micro-batch. A peer out of
        memory: undo and retry smaller with it. A peer's callback cancelled the micro-batch before its backward: undo it
        here too and cancel, so that every rank drops the same micro-batch and no collective waits"""
        if self.loader is None or not self.manual_sync or self.agreed: return
        counted = self._window().window.counts   # (before the accumulation's own `after_backward`: order)
        oom,cancelled = self._agree(cancelled=not counted)
        if oom: raise PeerOutOfMemory('another rank ran out of memory in this micro-batch')
        if cancelled and counted:
            self.snapshot.undo(drop=False)
            raise CancelBatchException()
    def after_cancel_batch(self):
        if self.loader is None or not self.manual_sync or self.agreed: return
        oom,_ = self._agree(cancelled=True)
        if oom: raise PeerOutOfMemory('another rank ran out of memory in this micro-batch')

    def after_batch(self):
        """Progress counts loader batches, as without micro-batches (schedules see the same). After a loader batch's
        last piece (never retried once here: an out-of-memory error skips `after_batch`) the model carries the whole
        batch's rows again, before a checkpoint (order 95) saves them (it saved the last piece's rows)"""
        piece = self.piece
        if piece is not None and piece.last_piece and self.rows.n is not None: self.rows.end()
        p = self.loader.progress() if self.loader is not None else None
        if p is not None: self.learn.pct_train = (self.learn.epoch + p)/self.learn.n_epoch

    def _agree(self, oom:bool=False, cancelled:bool=False)->tuple[bool,bool]:
        """Did any rank run out of memory, did any rank cancel this micro-batch before its backward? (one small
        all-reduce)"""
        self.agreed = True
        a,b = sum_over_ranks([float(oom), float(cancelled)], self.learn.model)
        return a > 0,b > 0

    # -- sizes
    # ----------------------------------------------------------------------------------------------------------
    def batch_started(self, n:int)->int:
        self._serial += 1
        if self.size is None: self.size = n
        p = self._probe
        if p is not None and p['stage'] in ('time_a', 'time_b'): p['t0'] = self._clock()
        return self._serial
    def batch_done(self, n:int):
        """'auto' on a GPU, outside DDP: once a size has run a loader batch, time it and the next smaller; keep the
        faster"""
        if not (self.auto and self.probe_on) or is_distributed(self.learn.model) or not self._probe_here(): return
        p = self._probe
        if p is None: self._probe = dict(stage='time_a' if self.size >= 2 else 'done', size=self.size); return
        if p['stage'] == 'time_a':
            p['rate_a'] = n/(self._clock()-p['t0'])
            self.trials[p['size']] = p['rate_a']
            self.size,p['stage'] = halved(p['size']),'warm_b'
            self._resize_epoch()
        elif p['stage'] == 'warm_b': p['stage'] = 'time_b'   # cuDNN picks its algorithms for the new shapes first
        elif p['stage'] == 'time_b':
            rate = n/(self._clock()-p['t0'])
            small = halved(p['size'])
            self.trials[small] = rate
            self.size = small if rate > p['rate_a'] else p['size']
            p['stage'] = 'done'
            if self.size == small:
                warnings.warn(f"GradientAccumulation: micro-batch {small} ran at {rate:.0f} items/s against "
                              f"{p['size']}'s {p['rate_a']:.0f}: micro_bs is now {small}", stacklevel=user_stacklevel())
            else: self._resize_epoch()

    def halve(self, msg:str):
        "After an undone out-of-memory micro-batch: half the size, and the same samples cut again"
        size = self.size
        if size <= 1:
            raise RuntimeError(f"MicroBatching('auto'): out of memory with a micro-batch of 1 item ({msg}). "
                               "The model does not fit this device at any micro-batch: free memory, use mixed "
                               "precision, a smaller model or smaller inputs") from None
        self.size,self._probe = halved(size),None
        self.loader.retry = True
        self._resize_epoch()
        warnings.warn(f"GradientAccumulation: out of memory with micro-batch {size} ({msg}); micro_bs is now "
                      f"{self.size}, and the same samples run again", stacklevel=user_stacklevel())

    def _resize_epoch(self):
        "The size changed mid-epoch: fastai's `n_iter` (schedules, ShortEpochCallback) and the progress bar follow it"
        learn,sp = self.learn,self.loader
        if sp is None or not getattr(learn, 'training', False): return
        n = getattr(learn, 'iter', -1) + 1 + sp.pieces_left()
        learn.n_iter = n
        pbar = getattr(getattr(learn, 'progress', None), 'pbar', None)
        if pbar is not None and getattr(pbar, 'total', None) is not None: pbar.total = n

    def _probe_here(self)->bool:
        "Time micro-batch sizes only on a GPU (the size matters there)"
        return next(self.learn.model.parameters()).is_cuda
    def _clock(self)->float:
        "Seconds, once the GPU has finished what was queued"
        if torch.cuda.is_available() and next(self.learn.model.parameters()).is_cuda: torch.cuda.synchronize()
        return time.perf_counter()

def micro_batching(learn)->MicroBatching|None:
    "The Learner's `MicroBatching` callback, or None"
    return next((cb for cb in learn.cbs if isinstance(cb, MicroBatching)), None)
def micro_size(learn)->int|None:
    """The micro-batch size the Learner's training cuts its loader batches to (None: not cut, or 'auto' before its first
    batch)"""
    mb = micro_batching(learn)
    return mb.size if mb is not None else None

class _OneBatch:
    """`learn.one_batch` under 'auto'. Training: a micro-batch that runs out of memory is undone and retried smaller
    (under DDP every rank agrees after each micro-batch). Inference: the model's forward and the loss are cut into
    pieces when a batch runs out of memory, and the events see the whole batch."""
    def __init__(self, learn, mb:MicroBatching): self.learn,self.mb,self.orig = learn,mb,learn.one_batch
    def __call__(self, i, b):
        mb = self.mb
        if not self.learn.training:
            mb.inference.train_size = mb.size
            return mb.inference.one_batch(self.orig, i, b)
        mb.agreed = False
        mb.snapshot.take()
        try: return self.orig(i, b)
        except BaseException as e:
            peer = isinstance(e, PeerOutOfMemory)
            if not ((peer or is_out_of_memory(e)) and mb.loader is not None): raise
            msg = first_line(e)
            e.__traceback__ = None   # its frames hold the attempt's tensors
        # the ranks that fitted wait in `after_backward`
        if not peer and mb.manual_sync and not mb.agreed: mb._agree(oom=True)
        mb.snapshot.undo()
        mb.halve(msg)
