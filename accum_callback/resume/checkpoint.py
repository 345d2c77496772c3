"""Stop anywhere, resume to the same weights: `Checkpoint`, a callback that saves everything the rest of a fit depends
on between two micro-batches (a window in progress included) and, when the same fit is run again, resumes it from the
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
import signal, warnings
from pathlib import Path

import torch.distributed as dist
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import LRFinder

from ..core.distributed import reduce_floats, is_distributed, process_count, process_rank
from ..core.protocols import (CANCELS, SaysPickled, StopSignals, add_fit_guard, fail_fit, in_inference,
                              refuse_at_fit_start, remove_fit_guard, user_stacklevel, window_owner)
from ..core.loaders import ReadAhead, can_skip, feed_of, inner_loader, is_last_batch, piece_of
# _MAGIC, read_...)
from .format import (MAGIC, AsJson, CheckpointError, Plain, json_normal, UnsafeCheckpoint, packed_state, plain_state,
                     read_checkpoint, write_checkpoint)
from .fit_place import FitPlace
from .fit_state import (apply_training_state, refuse_changes, callback_states, check_fit_state, fit_arguments,
                        fit_signature, training_state)
from .world_size import elastic_state, is_elastic, loader_signature, save_waits, source_rank
from .sharded import load_sharded, read_whole, remove_sharded, sharded_state, writes_sharded
from ..core.files import Background, serials, keep_copy, new_file_perms, remove_old, remove_stale_parts, writable_folder
from ..core.args import whole_number
from .cadence import MOVED, Cadence
_write,_MAGIC = write_checkpoint,MAGIC   # (the name bench/checkpoint_cost.py times; the magic's name before 0.3)

__all__ = ['Checkpoint', 'CheckpointError', 'UnsafeCheckpoint', 'read_checkpoint']

# a run of the same data and arguments (another seed) resumes a checkpoint in its folder as a re-run would: said with
# the fix
_OWN_RUN = ("a run of its own (another seed, a sweep) needs a folder of its own: "
            "Checkpoint(f'checkpoints/seed{seed}'); Checkpoint(resume=False) trains it again here")

class Checkpoint(SaysPickled, Callback):
    """Save the fit as `every` says (`'1ep'`: each epoch's end; `'3ba'`: every 3 loader batches, mid-window; `'30min'`;
    `'100st'` or 100: every 100 optimizer steps; a tuple: each, e.g. `('1ep', '30min')`; None: only on the signals) and
    when the process is asked to stop (SIGTERM, SIGINT: saved at the next micro-batch's end, then the fit stops:
    `KeyboardInterrupt`, or for SIGTERM `SystemExit(143)`). Keeps the last `keep` in `path` (relative: under
    `learn.path`). Run the same fit again and it resumes from the newest good checkpoint (`resume`), a finished fit's
    epochs are not run again; a checkpoint of another fit (window size, loader, world size, model) is refused naming
    what changed (`strict=False` accepts all but a model of other shapes)."""
    # after the Recorder (50) and the progress bar (60): their batch is done when we save; not in summary()'s pass
    order,run_valid,_only_train_loop = 95,True,True

    def __init__(self,
        path='checkpoints', # folder of the checkpoints (under `learn.path` if relative); one per fit run
        # when: '<n>ep' (epochs' ends), '<n>ba' (loader batches), '<n>min', '<n>st' or an int (optimizer steps), a
        # tuple of these; None: only on the signals
        every:int|str|tuple|None='1ep',
        keep:int=2, # checkpoints kept (the newest); at least 1
        resume:bool=True, # resume from the newest good checkpoint in `path` when there is one
        strict:bool=True, # refuse a checkpoint of another fit (False: accept what can be loaded, said in a warning)
        # SIGTERM/SIGINT: checkpoint at the next micro-batch's end, then stop (or a tuple of names, e.g. ('SIGTERM',))
        signals:bool|tuple=True,
        **moved, # (the keywords before 0.3: refused, naming their spelling in `every`)
    ):
        for k,v in moved.items():
            raise TypeError(f"Checkpoint: {MOVED[k](v)}" if k in MOVED else f"Checkpoint() got an unexpected keyword argument {k!r}")
        self.cadence = Cadence(every)
        whole_number(keep, 'keep')
        if signals is True: signals = ('SIGTERM', 'SIGINT')
        if not signals: signals = ()
        if not (isinstance(signals, (tuple, list)) and all(s in ('SIGTERM', 'SIGINT') for s in signals)):
            raise ValueError(f"`signals` must be True, False or a tuple of 'SIGTERM'/'SIGINT', got {signals!r}")
        self.path,self.signals,self.keep,self.resume,self.strict = path,tuple(signals),keep,bool(resume),bool(strict)
        self.n_fit,self.saved,self.resumed_from,self._writer,self.place = 0,[],None,Background(),FitPlace()

    @property
    def every(self): "`every` as given"; return self.cadence.every

    # -- where ----------------------------------------------------------------------------------------------------
    @property
    def folder(self)->Path:
        p = Path(self.path)
        return p if p.is_absolute() else Path(self.learn.path)/p
    def file(self, serial:int, rank:int)->Path:
        "The file of checkpoint `serial` that `rank` wrote"; return self.folder/f'ckpt-{serial:06d}.rank{rank}.pt'
    def _serials(self)->list: return serials(self.folder, 'ckpt-', '.pt')   # (the checkpoints there, any rank's)

    # -- fit ------------------------------------------------------------------------------------------------------
    def refuse_fit(self):
        """The folder is checked when the fit starts (`protocols.refuse_at_fit_start`): a folder, and one this process
        can write in"""
        if in_inference(self.learn) or any(isinstance(cb, LRFinder) for cb in self.learn.cbs): return
        writable_folder(self.folder, 'Checkpoint: `path`', 'the checkpoints')
        # what a killed write left (our names only, of processes no longer running)
        remove_stale_parts(self.folder, 'ckpt-')
        # every callback's state as a checkpoint can hold it (refused now, naming it, not at the first save)
        plain_state({k: get() for k,_,get,_ in callback_states(self.learn, self)}, "state['callbacks']")

    def before_fit(self):
        # `lr_find` is a fit of its own that puts the weights back: neither counted nor saved
        self._off = in_inference(self.learn) or any(isinstance(cb, LRFinder) for cb in self.learn.cbs)
        if self._off: return
        refuse_at_fit_start(self.learn)   # (every callback of ours, this one's folder included: before any sets up)
        self.n_fit += 1
        self._stop,self._exit,self._checked_steps,self._deferred,self._agreed = None,None,0,False,False
        self.cadence.start()
        self.place = FitPlace()
        self._opt_steps,self._step_cancelled = 0,False
        self.serial = max(self._serials(), default=0)
        self._sig,self._fit_args = None,{}; self._fit_args = fit_arguments(self.learn)
        self._signals = StopSignals(self.signals, self._asked)
        add_fit_guard(self.learn, 'checkpoint', lambda e: None if isinstance(e, CANCELS) else self._finish_fit(together=False))
        try:
            if self.resume: self._resume()
        except BaseException as e:   # a refused resume: the callbacks of ours before this one have set up already
            fail_fit(self.learn, e)
            raise

    def after_fit(self):
        if getattr(self, '_off', True): return
        if self._exit is None and not self.place.skipped_all(self.learn.n_epoch): self._save('done')
        self._finish_fit()
        # stopped by a signal, after the checkpoint: the process is asked to stop, not the fit
        if self._exit is not None:
            sig,self._exit = self._exit,None
            if sig == signal.SIGINT: raise KeyboardInterrupt('Checkpoint: saved, then stopped (SIGINT)')
            raise SystemExit(128 + sig)

    # (`together`: every rank is here; an exception may have stopped one only)
    def _finish_fit(self, together:bool=True):
        try: self._flush(together)   # (the checkpoint in flight written, whatever ended the fit)
        finally:
            self._writer.close()
            if getattr(self, '_signals', None) is not None: self._signals.remove(); self._signals = None
        remove_fit_guard(self.learn, 'checkpoint')

    def before_train(self):
        if self._off: return
        # the training loader read one batch ahead, with its place kept (`Feed`): `GradientAccumulation`'s or
        # `MicroBatching`'s where they run (ordered before this), else this callback's own, for a Learner without them
        if feed_of(self.learn.dl) is None: self.learn.dl = ReadAhead(self.learn.dl)
        self.place.start_epoch(self.learn)

    def before_batch(self):
        # a resumed epoch's `learn.iter` counts from its place, not from 0 (ShortEpochCallback stops at a fraction)
        if self.training and self.place.iter_offset: self.learn.iter += self.place.iter_offset

    def after_batch(self):
        if self._off or not self.training: return
        learn = self.learn
        piece = piece_of(learn.dl)   # (`MicroBatching`'s loader: the piece of a loader batch being run)
        if piece is not None and not piece.last_piece: return   # (the pieces of one loader batch: saved after its last)
        self.place.k += 1
        last = is_last_batch(learn.dl)
        if last or not (self._due() or self._deferred): return
        ga = self._ga()
        # FSDP2 and a `global_window` run save at the window's end (`world_size.save_waits`)
        if not can_skip(inner_loader(learn.dl)) or save_waits(ga, learn.model, self.cadence.batch_due(self.place.k)):
            self._deferred = True; return   # (a loader of ready-made batches: epoch ends only)
        self._deferred = False
        self._save('mid')
        self._after_save()

    def after_epoch(self):
        if self._off: return
        # (the Recorder appended its row)
        if self.place.skipped(self.epoch): return self.place.after_skipped_epoch(self.learn)
        if self.cadence.epoch_due(self.epoch) or self._due(end=True): self._save('end'); self._after_save()

    def _due(self, end:bool=False)->bool:
        "A checkpoint now? Rules every rank reads alike, and under DDP the clock and signals agreed at window ends"
        due = self.cadence.counted(self._steps(), self.place.k)
        if not is_distributed(self.learn.model): return due or self._stop is not None or self.cadence.timed()
        if (steps := self._steps()) == self._checked_steps and not end: return due
        self._checked_steps = steps   # (one all-reduce a window, where the step has one anyway)
        signalled,timed = reduce_floats([float(self._stop is not None), float(self.cadence.timed())]); self._agreed = bool(signalled)
        if signalled and self._stop is None: self._stop = signal.SIGTERM   # another rank was asked to stop: all stop
        return due or bool(signalled) or bool(timed)

    def _after_save(self):
        self.cadence.saved(self._steps())
        if self._stopping():   # asked to stop: the fit ends cleanly (every callback's `after_fit`), then the process
            self._exit,self._stop = self._stop,None; raise CancelFitException()

    def _stopping(self)->bool: "Asked to stop (under DDP agreed by every rank at the last window's end: a signal after it waits for the next)"; return self._stop is not None and (process_count() == 1 or self._agreed)

    def _asked(self, sig):
        "SIGTERM or SIGINT: a checkpoint at the next micro-batch's end, then the fit stops; asked twice: stop at once"
        if self._stop is not None: raise KeyboardInterrupt
        self._stop = sig

    def _ga(self): return window_owner(self.learn)   # (the window's owner, by its declared interface)

    # optimizer steps of this fit: the window's count, or without accumulation those no callback cancelled
    def _steps(self)->int:
        return ga.steps if (ga := self._ga()) is not None else self._opt_steps
    def after_cancel_step(self): self._step_cancelled = True
    def after_step(self):   # (a step no callback cancelled counts)
        self._opt_steps,self._step_cancelled = getattr(self, '_opt_steps', 0) + (not getattr(self, '_step_cancelled', False)),False

    # -- saving ---------------------------------------------------------------------------------------------------
    def signature(self)->dict:
        """What a resumed fit must share with the checkpoint's to continue it exactly (each is named where it differs):
        taken once a fit (nothing in it changes within one; every checkpoint holds it), read-only"""
        if getattr(self, '_sig', None) is None: self._sig = json_normal(fit_signature(self.learn, self.n_fit, getattr(self, '_fit_args', {}), loader_signature(self.learn, self._ga())))
        return self._sig

    # (not `_state`: fastcore's `Stateful` unpickles a Learner's callbacks with `_state = {}`)
    def _snapshot(self, where:str, whole:bool)->dict:
        """The fit's state, piece by piece: the place in the fit, what training has made (`whole`: the model too), what
        a resume must match"""
        return dict(self.place.state(self.learn, where), **training_state(self.learn, self, whole), signature=AsJson(self.signature()), opt_steps=self._opt_steps)

    def _save(self, where:str):
        """Take the state now (its tensors copied) and write it in the background while training goes on (the one
        before finished first: `_flush`); here where the model goes to a DCP folder (written by every rank together),
        at the fit's end, or before a stop"""
        self._flush()
        self.serial += 1
        # (else a DCP folder)
        f,whole = self.file(self.serial, process_rank()),not writes_sharded(self.learn.model, is_elastic(self._ga()))
        try: st,err = Plain(packed_state(sharded_state(self, self._snapshot(where, whole), self._ga())), new_file_perms()),None
        except OSError as e: st,err = None,e
        now = where == 'done' or not whole or self._stopping()   # (written before training goes on: no thread for it)
        # (one process: its file written is the checkpoint, so the old ones are removed in the same job, off the main
        # thread)
        if st is not None: self._writer.start(lambda: (_write(f, st), self._remove_old() if process_count() == 1 else None), now)
        self._inflight = (f, self.serial, self.folder/f'fit-{self.n_fit:06d}.rank{process_rank()}.pt' if where == 'done' and whole else None, err)
        if now: self._flush()

    def _flush(self, together:bool=True):
        """The checkpoint in flight: written, counted once every rank has written its file, the old ones removed, a
        finished fit's end kept (`fit-<n>`); a write that failed (a full disk, a folder made read-only) said, and
        training goes on: the next one due tries again"""
        pending,self._inflight = getattr(self, '_inflight', None),None
        if pending is None: return
        (f,serial,keep,err),(out,e) = pending,self._writer.wait()
        if e is not None and not isinstance(e, OSError): raise e
        if err or e:
            last = self.file(self.saved[-1], process_rank()) if self.saved else None
            warnings.warn(f"Checkpoint: could not write {f} ({type(err or e).__name__}: {err or e}); training goes on, the last "
                          f"good checkpoint is {last or 'none yet'}, the next one due tries again", stacklevel=user_stacklevel())
        if process_count() > 1:   # a checkpoint counts once every rank wrote its file (after an exception on some: not
            if not together: return   # known, so nothing is counted or removed)
            dist.barrier()
        if err or e: return
        if keep is not None and (x := keep_copy(f, keep)) is not None:   # this fit's end, kept for a re-run
            warnings.warn(f"Checkpoint: could not keep this fit's end in {self.folder} ({x}): a re-run of it will not be restored", stacklevel=user_stacklevel())
        self.saved.append(serial)
        # (one process: removed in the write's job; one that cannot be removed is said, training goes on)
        for s,x in (out[1] if process_count() == 1 else self._remove_old()):
            warnings.warn(f"Checkpoint: could not remove the old checkpoint {s} in {self.folder} ({type(x).__name__}: {x}); training goes on", stacklevel=user_stacklevel())

    def _remove_old(self)->list: return remove_old(self._serials(), self.keep, lambda s: (self.file(s, process_rank()).unlink(missing_ok=True), remove_sharded(self.folder, f'ckpt-{s:06d}.dcp')))

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
                # (0.2's files: tuples)
                if isinstance(st.get('signature'), dict): st['signature'] = json_normal(st['signature'])
                check_fit_state(st, self.learn, self, f, now)
                mine = st   # (a `global_window` run on as many processes: each rank resumes its own file, checked too)
                if elastic and process_rank() and st['world'] == process_count():
                    check_fit_state(mine := read_checkpoint(self.file(s, process_rank())), self.learn, self, self.file(s, process_rank()))
                ok = 1.
            except (CheckpointError, ValueError, OSError, RuntimeError, EOFError) as e:
                warnings.warn(f"Checkpoint: passed over {f}, which cannot be resumed ({str(e)[:300]}); trying the one before", stacklevel=user_stacklevel())
                st,mine,ok = None,None,0.
            if process_count() > 1: ok = reduce_floats([ok], dist.ReduceOp.MIN)[0]
            if ok: return s,st,mine
        return None

    def _resume(self):
        found = self._newest()
        if found is None: return
        serial,st,mine = found
        self.resumed_from = self.file(serial, source_rank(self._ga()))
        # (rank 0's file, maybe of another number of processes)
        if is_elastic(self._ga()): st,self.resumed_from = elastic_state(self, serial, st, self._ga(), mine)
        sig,now = st['signature'],self.signature()
        # this fit finished before the cut
        if sig['fit'] > now['fit'] or (sig['fit'] == now['fit'] and st['where'] == 'done'):
            if sig['fit'] > now['fit']:   # a later fit's: this one's end as kept (`fit-<n>`), checked whole
                found = self._newest([self.folder/f'fit-{now["fit"]:06d}.rank{r}.pt' for r in (process_rank(), 0)])
                sig,st,self.resumed_from = (found[1]['signature'],found[1],found[0]) if found else (now,None,None)
            if st is not None:
                # (a finished fit rerun with other arguments: refused, not returned)
                refuse_changes(sig, now, self.resumed_from, self.strict)
                self._load(st)
            self._skip_epochs(self.learn.n_epoch)
            warnings.warn(f"Checkpoint: this fit finished before ({self.resumed_from}): nothing is trained, the model is as it ended; "
                          f"{_OWN_RUN}" if st is not None else "Checkpoint: this fit "
                          "finished before a later fit's checkpoint, and no record of its end is kept: nothing is trained and the model "
                          f"is NOT as it ended; {_OWN_RUN}", stacklevel=user_stacklevel())
            return
        if sig['fit'] < now['fit']: return   # (an earlier fit's: this one starts afresh)
        refuse_changes(sig, now, self.resumed_from, self.strict)
        self._load(st)
        # (a mid-epoch place goes on where its epoch's training starts)
        self._skip_epochs(st['epoch'] + (st['where'] == 'end'))

    def _load(self, st:dict):
        """Put the state back, piece by piece (checked whole before: `_newest`); a mid-epoch place goes on in
        `before_train`"""
        if st.get('sharded'): st = load_sharded(self.folder, st, self.learn.model, self.learn.opt)
        apply_training_state(self.learn, st, self)
        self._opt_steps = st.get('opt_steps', 0); self.cadence.start(self._opt_steps)
        self.place.load(self.learn, st)

    def _skip_epochs(self, first:int): self.place.skip_epochs(self.learn, first, [cb for _,cb,_,_ in callback_states(self.learn, self)])

    def before_epoch(self):
        if not getattr(self, '_off', True): self.place.skip_epoch(self.learn)
