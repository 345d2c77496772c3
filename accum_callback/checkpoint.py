"""Stop anywhere, resume to the same weights: `Checkpoint`, a callback that saves everything the rest of a fit depends on
between two micro-batches (a window in progress included) and, when the same fit is run again, resumes it from the
newest good checkpoint, bitwise where the run is deterministic (docs/resume.md).

What is saved: the model (parameters and buffers) and the gradients a window has accumulated so far, the optimizer
with fastai's hyper-parameters, the grad scaler, every global RNG (Python, numpy, torch CPU and CUDA) and the training
loader's (its order of the epoch, drawn at the epoch's start), the place in the fit (epoch, loader batches done,
`pct_train`, the schedule's clock in windows), the Recorder's history, the model's carried state (AWD_LSTM's hidden),
and the state of every callback with `state_dict()`/`load_state_dict()` (ours: the window and its logs,
`MicroBatching`'s size, `BatchNormAccumulation`'s pooled statistics or momenta, `GradientNoiseScale`'s averages and its
schedules' values; a user's) and fastai's trackers' (`EarlyStopping`, `SaveModelCallback`, `ReduceLROnPlateau`: best
value and patience). Written atomically (`files.atomic_write`) with a
CRC-32 of the contents: a checkpoint cut at any byte, truncated or damaged is never loaded, the one before it is."""
from __future__ import annotations
import re, signal, threading, time, warnings
from pathlib import Path

import torch
import torch.distributed as dist
from fastai.callback.core import Callback, CancelEpochException, CancelFitException
from fastcore.foundation import L
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.schedule import LRFinder
from fastai.torch_core import find_device, to_device

from .accumulate import GradientAccumulation
from .compat import local_tensor, rng_states, set_rng_states
from .fastai_compat import train_metrics
from .distributed import reduce_floats, is_distributed, process_count, process_rank, unwrap
from .guard import CANCELS, add_fit_guard, fail_fit, in_inference, refuse_at_fit_start, remove_fit_guard
from .micro import MicroBatching
from .micro.loader import ReadAhead, can_skip
from .checkpoint_format import (MAGIC, CheckpointError, UnsafeCheckpoint, plain_state, read_checkpoint, reshard,  # (re-exported:
                                write_checkpoint)                                                               # _MAGIC, read_...)
from .fit_state import (callback_states, carried_state, fit_arguments, load_carried_state, loader_orders, loader_rngs, plain_numbers,
                        restore_recorder, set_loader_orders, set_loader_rngs, settle_loaders, check_fit_state, fit_signature)
from .elastic import elastic_state, is_elastic, loader_signature, save_waits, source_rank
from .sharded_checkpoint import load_sharded, read_whole, remove_sharded, sharded_state, writes_sharded
from .files import keep_copy, remove_stale_parts, writable_folder
from .validate import whole_number
_write,_MAGIC = write_checkpoint,MAGIC   # (the name bench/checkpoint_cost.py times; the magic's name before 0.3)

__all__ = ['Checkpoint', 'CheckpointError', 'UnsafeCheckpoint', 'read_checkpoint']

class Checkpoint(Callback):
    """Save the fit every `every` optimizer steps, every `minutes`, at epoch ends (`epoch_end`) and when the process is
    asked to stop (SIGTERM, SIGINT: saved at the next micro-batch's end, then the fit stops: `KeyboardInterrupt`, or for
    SIGTERM `SystemExit(143)`); `batches`: every that many loader batches (mid-window). Keeps the last `keep` in `path`
    (relative: under `learn.path`). Run the same fit again and it resumes from the newest good checkpoint (`resume`),
    a finished fit's epochs are not run again; a checkpoint of another fit (window size, loader, world size, model) is
    refused naming what changed (`strict=False` accepts all but a model of other shapes)."""
    order,run_valid,_only_train_loop = 95,True,True   # after the Recorder (50) and the progress bar (60): their batch is done when we save; not in summary()'s pass

    def __init__(self,
        path='checkpoints', # folder of the checkpoints (under `learn.path` if relative); one per fit run
        every:int|None=None, # optimizer steps between two checkpoints
        minutes:float|None=None, # minutes between two checkpoints (checked at micro-batches' ends)
        batches:int|None=None, # loader batches between two checkpoints (mid-window ones included)
        epoch_end:bool=True, # a checkpoint at each epoch's end
        signals:bool|tuple=True, # SIGTERM/SIGINT: checkpoint at the next micro-batch's end, then stop (or a tuple of names, e.g. ('SIGTERM',))
        keep:int=2, # checkpoints kept (the newest); at least 1
        resume:bool=True, # resume from the newest good checkpoint in `path` when there is one
        strict:bool=True, # refuse a checkpoint of another fit (False: accept what can be loaded, said in a warning)
    ):
        if every is not None: whole_number(every, 'every')
        if batches is not None: whole_number(batches, 'batches')
        if minutes is not None and not (isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and minutes > 0):
            raise ValueError(f"`minutes` must be a number > 0, got {minutes!r}")
        whole_number(keep, 'keep')
        self.path,self.every,self.minutes,self.batches,self.epoch_end = path,every,minutes,batches,bool(epoch_end)
        if signals is True: signals = ('SIGTERM', 'SIGINT')
        if not signals: signals = ()
        if not (isinstance(signals, (tuple, list)) and all(s in ('SIGTERM', 'SIGINT') for s in signals)):
            raise ValueError(f"`signals` must be True, False or a tuple of 'SIGTERM'/'SIGINT', got {signals!r}")
        self.signals,self.keep,self.resume,self.strict = tuple(signals),keep,bool(resume),bool(strict)
        self.n_fit,self.saved,self.resumed_from = 0,[],None

    # -- where ----------------------------------------------------------------------------------------------------
    @property
    def folder(self)->Path:
        p = Path(self.path)
        return p if p.is_absolute() else Path(self.learn.path)/p
    def file(self, serial:int, rank:int)->Path: "The file of checkpoint `serial` that `rank` wrote"; return self.folder/f'ckpt-{serial:06d}.rank{rank}.pt'
    def _serials(self)->list:
        found = set()
        for f in self.folder.glob('ckpt-*.rank*.pt'):
            m = re.fullmatch(r'ckpt-(\d+)\.rank(\d+)\.pt', f.name)
            if m: found.add(int(m.group(1)))
        return sorted(found)

    # -- fit ------------------------------------------------------------------------------------------------------
    def refuse_fit(self):
        "The folder is checked when the fit starts (`guard.refuse_at_fit_start`): a folder, and one this process can write in"
        if in_inference(self.learn) or any(isinstance(cb, LRFinder) for cb in self.learn.cbs): return
        writable_folder(self.folder, 'Checkpoint: `path`', 'the checkpoints')
        remove_stale_parts(self.folder, 'ckpt-')   # what a killed write left (our names only, of processes no longer running)
        # every callback's state as a checkpoint can hold it (refused now, naming it, not at the first save)
        plain_state({k: get() for k,_,get,_ in callback_states(self.learn, self)}, "state['callbacks']")

    def before_fit(self):
        # `lr_find` is a fit of its own that puts the weights back: neither counted nor saved
        self._off = in_inference(self.learn) or any(isinstance(cb, LRFinder) for cb in self.learn.cbs)
        if self._off: return
        refuse_at_fit_start(self.learn)   # (every callback of ours, this one's folder included: before any sets up)
        self.n_fit += 1
        self._k,self._stop,self._exit,self._t0,self._last_steps,self._skip_to = 0,None,None,time.monotonic(),0,None
        self._epoch_rngs,self._pending,self._checked_steps,self._deferred = None,None,0,False
        self._opt_steps,self._step_cancelled = 0,False
        self.serial = max(self._serials(), default=0)
        self._fit_args = {}; self._fit_args = fit_arguments(self.learn)
        self._install_signals()
        add_fit_guard(self.learn, 'checkpoint', lambda e: None if isinstance(e, CANCELS) else self._finish_fit())
        try:
            if self.resume: self._resume()
        except BaseException as e:   # a refused resume: the callbacks of ours before this one have set up already
            fail_fit(self.learn, e)
            raise

    def after_fit(self):
        if getattr(self, '_off', True): return
        skipped_all = self._skip_to is not None and self._skip_to >= self.learn.n_epoch
        if self._exit is None and not skipped_all: self._save('done')
        self._finish_fit()
        if self._exit is not None:   # stopped by a signal, after the checkpoint: the process is asked to stop, not the fit
            sig,self._exit = self._exit,None
            if sig == signal.SIGINT: raise KeyboardInterrupt('Checkpoint: saved, then stopped (SIGINT)')
            raise SystemExit(128 + sig)

    def _finish_fit(self):
        self._uninstall_signals()
        remove_fit_guard(self.learn, 'checkpoint')

    def before_train(self):
        if self._off: return
        # the training loader read one batch ahead, with its place kept (`Feed`): `GradientAccumulation`'s or
        # `MicroBatching`'s where they run (ordered before this), else this callback's own, for a Learner without them
        if getattr(self.learn.dl, 'feed', None) is None: self.learn.dl = ReadAhead(self.learn.dl)
        dl = self.learn.dl
        self._epoch_rngs = loader_rngs(self._inner(dl))   # the order of this epoch is drawn from these
        self._epoch_start = rng_states()   # (and from these, by loaders that draw from the global RNGs: LMDataLoader)
        self._epoch_orders = loader_orders(self._inner(dl))
        self._k,self._iter_offset = 0,0
        if self._pending is not None: self._continue(self._pending); self._pending = None

    def before_batch(self):
        # a resumed epoch's `learn.iter` counts from its place, not from 0 (ShortEpochCallback stops at a fraction)
        if self.training and getattr(self, '_iter_offset', 0): self.learn.iter += self._iter_offset

    def _inner(self, dl): return dl.__dict__.get('dl', dl)   # the loader our read-ahead wraps

    def after_batch(self):
        if self._off or not self.training: return
        learn = self.learn
        mb = next((cb for cb in learn.cbs if isinstance(cb, MicroBatching)), None)
        piece = getattr(getattr(mb, 'loader', None), 'piece', None)
        if piece is not None and not piece.last_piece: return   # (the pieces of one loader batch: saved after its last)
        self._k += 1
        last = getattr(learn.dl, 'last', None) if piece is None else piece.last_batch
        if last or not (self._due() or self._deferred): return
        ga = self._ga()
        # FSDP2 and a `global_window` run save at the window's end (`elastic.save_waits`)
        if not can_skip(self._inner(learn.dl)) or save_waits(ga, learn.model, self.batches is not None and self._k % self.batches == 0):
            self._deferred = True; return   # (a loader of ready-made batches: epoch ends only)
        self._deferred = False
        self._save('mid')
        self._after_save()

    def after_epoch(self):
        if self._off: return
        if self._skipped():   # the Recorder appended this epoch's row: its count of iterations as the checkpoint kept it
            rec,(_,iters) = self.learn.recorder,self._rows
            if self.epoch < len(iters) and rec.iters: rec.iters[-1] = iters[self.epoch]
            if self.epoch == self._skip_to - 1:
                for cb in self._quiet: cb.run = True
            return
        if self.epoch_end or self._due(end=True): self._save('end'); self._after_save()

    def _due(self, end:bool=False)->bool:
        "A checkpoint now? Rules every rank reads alike, and under DDP the clock and signals agreed at window ends"
        steps = self._steps()
        due = ((self.every is not None and steps - self._last_steps >= self.every) or
               (self.batches is not None and self._k % self.batches == 0))
        if not is_distributed(self.learn.model):
            return due or self._stop is not None or (self.minutes is not None and time.monotonic() - self._t0 >= 60*self.minutes)
        if steps == self._checked_steps and not end: return due
        self._checked_steps = steps   # (one all-reduce a window, where the step has one anyway)
        timed = self.minutes is not None and time.monotonic() - self._t0 >= 60*self.minutes
        signalled,timed = reduce_floats([float(self._stop is not None), float(timed)])
        if signalled and self._stop is None: self._stop = signal.SIGTERM   # another rank was asked to stop: all stop
        return due or bool(signalled) or bool(timed)

    def _after_save(self):
        self._last_steps,self._t0 = self._steps(),time.monotonic()
        if self._stop is not None:   # asked to stop: the fit ends cleanly (every callback's `after_fit`), then the process
            self._exit,self._stop = self._stop,None
            raise CancelFitException()

    def _ga(self): return next((cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation)), None)

    def _steps(self)->int:   # optimizer steps of this fit: the window's count, or without accumulation those no callback cancelled
        return ga.steps if (ga := self._ga()) is not None else self._opt_steps
    def after_cancel_step(self): self._step_cancelled = True
    def after_step(self):
        if not getattr(self, '_step_cancelled', False): self._opt_steps = getattr(self, '_opt_steps', 0) + 1
        self._step_cancelled = False

    # -- signals --------------------------------------------------------------------------------------------------
    def _install_signals(self):
        self._old = {}
        if not self.signals or threading.current_thread() is not threading.main_thread(): return
        def handler(sig, frame):
            if self._stop is not None: raise KeyboardInterrupt   # twice: stop at once
            self._stop = sig
        for s in self.signals: self._old[getattr(signal, s)] = signal.signal(getattr(signal, s), handler)

    def _uninstall_signals(self):
        for s,h in getattr(self, '_old', {}).items(): signal.signal(s, h)
        self._old = {}

    # -- saving ---------------------------------------------------------------------------------------------------
    def signature(self)->dict:
        "What a resumed fit must share with the checkpoint's to continue it exactly (each is named where it differs)"
        return fit_signature(self.learn, self._ga(), self.n_fit, getattr(self, '_fit_args', {}), loader_signature(self.learn, self._ga()))

    def _snapshot(self, where:str)->dict:   # (not `_state`: fastcore's `Stateful` unpickles a Learner's callbacks with `_state = {}`)
        learn,model = self.learn,unwrap(self.learn.model)
        whole = not writes_sharded(learn.model, is_elastic(self._ga()))   # (else the model goes to a DCP folder: `sharded_state`)
        params = [p for p in model.parameters()]
        rec = learn.recorder
        mets = [plain_numbers(m) for m in train_metrics(rec)]
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        feed = getattr(learn.dl, 'feed', None) if where == 'mid' else None
        return dict(
            where=where, world=process_count(), epoch=learn.epoch, k=self._k, iter_done=getattr(learn, 'iter', -1) + 1 if where == 'mid' else 0, signature=self.signature(), opt_steps=self._opt_steps,
            model={k: local_tensor(v).clone() for k,v in model.state_dict().items()} if whole else {},
            grads=[None if p.grad is None or not whole else local_tensor(p.grad).clone() for p in params],
            opt=learn.opt.state_dict() if learn.opt is not None else None,
            scaler=mp.scaler.state_dict() if mp is not None and getattr(mp, 'scaler', None) is not None else None,
            rngs=rng_states(), epoch_rngs=self._epoch_start if where == 'mid' else None,
            loader_orders=self._epoch_orders if where == 'mid' else loader_orders(self._inner(learn.dls.train)),
            carried=carried_state(model) if where == 'mid' else None, ahead=to_device(feed.ahead, 'cpu') if feed is not None and feed.ahead is not None else None,
            ahead_device=find_device(feed.ahead) if feed is not None and feed.ahead is not None else None,
            loader_rngs=self._epoch_rngs if where == 'mid' else loader_rngs(self._inner(learn.dls.train)),
            pct_train=getattr(learn, 'pct_train', 0.), train_iter=getattr(learn, 'train_iter', 0),
            recorder=dict({k: getattr(rec, k) for k in ('lrs', 'iters', 'losses', 'values') if hasattr(rec, k)},
                          smooth=plain_numbers(rec.smooth_loss), mets=mets),
            callbacks={k: get() for k,_,get,_ in callback_states(learn, self)})

    def _save(self, where:str):
        self.serial += 1
        f = self.file(self.serial, process_rank())
        try: _write(f, sharded_state(self, self._snapshot(where), self._ga())); ok = True
        except OSError as e:   # a full disk, a folder made read-only: said, and training goes on (the next one tries again)
            ok = False
            last = self.file(self.saved[-1], process_rank()) if self.saved else None
            warnings.warn(f"Checkpoint: could not write {f} ({type(e).__name__}: {e}); training goes on, the last good "
                          f"checkpoint is {last or 'none yet'}, the next one due tries again", stacklevel=2)
        if process_count() > 1: dist.barrier()   # (a checkpoint counts once every rank wrote its file)
        if not ok: return
        if where == 'done' and not writes_sharded(self.learn.model, is_elastic(self._ga())):   # this fit's end, kept for a re-run
            if (e := keep_copy(f, self.folder/f'fit-{self.n_fit:06d}.rank{process_rank()}.pt')) is not None:
                warnings.warn(f"Checkpoint: could not keep this fit's end in {self.folder} ({e}): a re-run of it will not be restored", stacklevel=2)
        self.saved.append(self.serial)
        for s in self._serials()[:-self.keep]:   # (one that cannot be removed is said: the checkpoint is written, training goes on)
            try: self.file(s, process_rank()).unlink(missing_ok=True); remove_sharded(self.folder, f'ckpt-{s:06d}.dcp')
            except OSError as e: warnings.warn(f"Checkpoint: could not remove the old checkpoint {s} in {self.folder} ({type(e).__name__}: {e}); training goes on", stacklevel=2)

    # -- resuming -------------------------------------------------------------------------------------------------
    def _newest(self, records:list|None=None):
        """The newest checkpoint every rank can read whole and apply (checked whole: `fit_state.check_fit_state`), or
        None; one that cannot be (cut, damaged, planted, malformed, another rank's file missing) is passed over, said.
        `records`: the files of a finished fit's end instead (the first that exists), `(file, state, state)` or None"""
        elastic,now = is_elastic(self._ga()) and records is None,self.signature()
        for s in ([f for f in records if f.is_file()][:1] if records else reversed(self._serials())):
            f = s if records else self.file(s, source_rank(self._ga()))
            try:
                st = read_whole(f, self.folder)
                check_fit_state(st, self.learn, self, f, now)
                mine = st   # (a `global_window` run on as many processes: each rank resumes its own file, checked too)
                if elastic and process_rank() and st['world'] == process_count():
                    check_fit_state(mine := read_checkpoint(self.file(s, process_rank())), self.learn, self, self.file(s, process_rank()))
                ok = 1.
            except (CheckpointError, ValueError, OSError, RuntimeError, EOFError) as e:
                warnings.warn(f"Checkpoint: passed over {f}, which cannot be resumed ({str(e)[:300]}); trying the one before", stacklevel=2)
                st,mine,ok = None,None,0.
            if process_count() > 1: ok = reduce_floats([ok], dist.ReduceOp.MIN)[0]
            if ok: return s,st,mine
        return None

    def _resume(self):
        found = self._newest()
        if found is None: return
        serial,st,mine = found
        self.resumed_from = self.file(serial, source_rank(self._ga()))
        if is_elastic(self._ga()): st,self.resumed_from = elastic_state(self, serial, st, self._ga(), mine)   # (rank 0's file, maybe of another number of processes)
        sig,now = st['signature'],self.signature()
        if sig['fit'] > now['fit'] or (sig['fit'] == now['fit'] and st['where'] == 'done'):   # this fit finished before the cut
            if sig['fit'] > now['fit']:   # a later fit's: this one's end as kept (`fit-<n>`), checked whole
                found = self._newest([self.folder/f'fit-{now["fit"]:06d}.rank{r}.pt' for r in (process_rank(), 0)])
                sig,st,self.resumed_from = (found[1]['signature'],found[1],found[0]) if found else (now,None,None)
            if st is not None:
                self._refuse_changes(sig, now)   # (a finished fit rerun with other arguments: refused, not returned)
                self._load(st)
            self._skip_epochs(self.learn.n_epoch)
            warnings.warn(f"Checkpoint: this fit finished before ({self.resumed_from}): nothing is trained, the model is as it ended; "
                          "Checkpoint(resume=False) or another `path` trains it again" if st is not None else "Checkpoint: this fit "
                          "finished before a later fit's checkpoint, and no record of its end is kept: nothing is trained and the model "
                          "is NOT as it ended; Checkpoint(resume=False) or another `path` trains it again", stacklevel=2)
            return
        if sig['fit'] < now['fit']: return   # (an earlier fit's: this one starts afresh)
        self._refuse_changes(sig, now)
        self._load(st)
        if st['where'] == 'end': self._skip_epochs(st['epoch'] + 1)
        else:
            self._skip_epochs(st['epoch'])
            self._pending = st   # continued where its epoch's training starts (`before_train`)

    def _refuse_changes(self, old:dict, new:dict):
        changed = [k for k in old if old.get(k) != new.get(k)]
        if not changed: return
        if 'model' in changed:
            raise CheckpointError(f"Checkpoint: {self.resumed_from} is of a model of other shapes; start afresh with "
                                  "Checkpoint(..., resume=False) or another `path`")
        what = '; '.join(f"{k}: {old[k]!r} then, {new.get(k)!r} now" for k in changed)
        if self.strict:
            raise CheckpointError(f"Checkpoint: cannot resume {self.resumed_from} exactly, {what}. Run the fit as it was, "
                                  "start afresh with Checkpoint(..., resume=False), or accept it with strict=False")
        warnings.warn(f"Checkpoint: resuming {self.resumed_from} with {what} (strict=False): not the run it would have been")

    def _load(self, st:dict):
        learn,model = self.learn,unwrap(self.learn.model)
        settle_loaders(learn.dls)   # (before the RNGs are put back)
        if st.get('sharded'): st = load_sharded(self.folder, st, learn.model, learn.opt)
        with torch.no_grad():
            sd = model.state_dict()
            for k,v in st['model'].items(): local_tensor(sd[k]).copy_(v)
            for p,g in zip(model.parameters(), st['grads']):
                if g is None: p.grad = None
                elif p.grad is None: p.grad = g.to(local_tensor(p).device) if not hasattr(p, 'to_local') else None
                else: local_tensor(p.grad).copy_(g)
        if st['opt'] is not None and learn.opt is not None:
            ps = [p for p,*_ in learn.opt.all_params(with_grad=False)]
            if len(ps) == len(st['opt'].get('state', ())):   # (FSDP2: each parameter's state as its DTensor again)
                st['opt']['state'] = [reshard(s_, p) for s_,p in zip(st['opt']['state'], ps)]
            learn.opt.load_state_dict(st['opt'])
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        if st['scaler'] is not None and mp is not None and getattr(mp, 'scaler', None) is not None: mp.scaler.load_state_dict(st['scaler'])
        restore_recorder(learn.recorder, st['recorder'])
        for k,_,_,put in callback_states(learn, self):
            if k in st['callbacks']: put(st['callbacks'][k])
        learn.epoch,learn.pct_train,learn.train_iter = st['epoch'],st['pct_train'],st['train_iter']
        self._opt_steps = self._last_steps = st.get('opt_steps', 0)
        if st['where'] != 'mid':
            set_rng_states(st['rngs'])
            set_loader_rngs(self._inner(learn.dls.train), st['loader_rngs'])
            set_loader_orders(self._inner(learn.dls.train), st.get('loader_orders'))

    def _continue(self, st:dict):
        "The epoch the checkpoint was taken in starts: its order, the batches done skipped unloaded, the RNGs as they were"
        learn = self.learn
        inner = self._inner(learn.dl)
        set_loader_rngs(inner, st['loader_rngs'])
        set_loader_orders(inner, st.get('loader_orders'))
        self._epoch_rngs,self._epoch_orders = st['loader_rngs'],st.get('loader_orders')
        feed = learn.dl.feed
        # the batches done, and the one read ahead (saved: made again, its random transforms would draw again), skipped
        feed.skip = st['k'] + (st['ahead'] is not None)
        if st['ahead'] is not None: feed.first = to_device(st['ahead'], st['ahead_device'])
        if st.get('epoch_rngs') is not None:   # the loader draws the epoch's order as at its start, then the batches
            set_rng_states(st['epoch_rngs'])   # after the one read ahead draw from where the interrupted run was
            self._epoch_start = st['epoch_rngs']
            feed.then = lambda: set_rng_states(st['rngs'])
        else: set_rng_states(st['rngs'])
        if st.get('carried'): load_carried_state(unwrap(learn.model), st['carried'])   # (after ModelResetter's reset)
        self._k,self._iter_offset = st['k'],st.get('iter_done', 0)
        # (fastai's `before_train` set these for the epoch's start after `_load`: its place in the epoch again)
        learn.pct_train,learn.train_iter = st['pct_train'],st['train_iter']
        restore_recorder(learn.recorder, st['recorder'])

    def _skip_epochs(self, first:int):
        """Epochs before `first` are done: each is cancelled in `before_epoch` (fastai's own `SkipToEpoch` mechanism),
        so every callback sees its events (the progress bar, `ShowGraphCallback`, `CSVLogger`), and the Recorder logs
        the row the checkpoint kept for it"""
        self._skip_to = first
        # the callbacks whose state was restored sit the skipped epochs out (fastai's `Callback.run`): a tracker seeing a
        # done epoch's row again counts it twice (ReduceLROnPlateau cut the learning rate again, EarlyStopping stopped)
        self._quiet = [cb for _,cb,_,_ in callback_states(self.learn, self)] if first > 0 else []
        for cb in self._quiet: cb.run = False
        rec = self.learn.recorder
        self._rows = list(getattr(rec, 'values', [])),list(getattr(rec, 'iters', []))
        rec.values,rec.iters = [],[]   # (appended again, epoch by epoch, as the skipped epochs end)

    def before_epoch(self):
        if getattr(self, '_off', True) or self._skip_to is None or self.epoch >= self._skip_to: return
        values,_ = self._rows
        if self.epoch < len(values): self.learn.recorder.log = L([self.epoch]) + L(values[self.epoch])
        raise CancelEpochException()

    def _skipped(self)->bool: return self._skip_to is not None and self.epoch < self._skip_to
