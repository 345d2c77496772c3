"""Fit bookkeeping shared by the callbacks: what a fit is refused for (checked before any of ours sets anything up),
clean-up when an exception leaves `fit`, and telling a fit from inference"""
from __future__ import annotations

import copy, inspect, os, sys, warnings
import torch.nn as nn
from fastai.callback.core import Callback, CancelEpochException, CancelFitException
from fastai.learner import defaults
from fastai.callback.training import BnFreeze, GradientAccumulation as FastaiGradientAccumulation

from ..compat.torch import BatchNormBase, compiled_with_cuda_graphs
from ..compat.fastai import clear_epoch_events, epoch_events, set_epoch_events
from .distributed import check_fsdp

__all__ = ['StopSignals', 'WindowOwner', 'window_owner', 'RunningStatsPolicy', 'ResumeSignature', 'resume_keys',
           'resume_signatures', 'bn_layers_with_stats', 'trained_bn_layers', 'FitGuard', 'add_fit_guard', 'fail_fit',
           'remove_fit_guard', 'in_inference', 'Listeners', 'one_per_learner', 'refuse_twins',
           'refuse_at_fit_start', 'refuse_accumulation_conflicts', 'say_fastai_accumulation', 'FastaiAccumulationCheck',
           'SaysPickled', 'is_ours', 'user_stacklevel']

CANCELS = (CancelEpochException, CancelFitException)  # after these, fit still goes on to `after_fit`

# -- interfaces by which the layers below a callback find it (by class, never by a name or `hasattr`)
# --------------------
class WindowOwner:
    """The window's owner (`GradientAccumulation`) as the parts beside and below it see it: `MicroBatching` finds it by
    this class and undoes a micro-batch through `window_state()` / `restore_window(state)`; `BatchNormAccumulation` and
    `GradientNoiseScale` follow its windows (`window_start`, `closes`, `on_window_close`). The owner holds `window` (a
    `window.state.Window`) and `window_listeners` (`Listeners`, called with `stepped` as a window closes)"""
    def window_state(self)->tuple[dict,bool]:
        """What undoing the micro-batch in progress puts back in the window (`restore_window`), and whether the window
        holds gradients"""
        return self.window.snapshot(),self.window.is_open
    def restore_window(self, state:dict): self.window.restore(state)
    @property
    def window_start(self)->bool:
        "Is the micro-batch being processed the first of its window?"; return self.window.n_micro == 0
    @property
    def closes(self)->bool:
        "Does the micro-batch being processed close its window (step or drop)?"; return self.window.closes
    def on_window_close(self, fn):
        """Call `fn(stepped:bool)` each time a window closes: stepped, or dropped/skipped/cancelled with its gradients
        zeroed"""
        return self.window_listeners.add(fn)
    def remove_window_listener(self, fn): self.window_listeners.discard(fn)
    # what the parts beside the window read of its size and rule (the owner's `plan` stays its own)
    @property
    def window_over_ranks(self)->bool:
        """Is the window `target_bs` samples of all ranks together, the same samples on any number of them
        (`global_window`)?"""
        return self.plan.global_window
    @property
    def window_samples(self)->int|None:
        "The window's samples now (over all ranks where `window_over_ranks`), None where it counts micro-batches"
        return self.plan.target_bs() if self.plan.by_items else None
    def window_batches(self, bs:int)->int:
        "Loader batches of `bs` items a full window takes on this rank now"; return self.plan.units(0, bs)
    @property
    def window_partial(self)->str:
        "What is done with a window an epoch's end cuts short: 'step', 'drop' or 'carry'"; return self.plan.partial
    @property
    def one_micro_windows(self)->bool:
        "Is every window one micro-batch (`n_step=1`)?"; return not self.plan.by_items and self.plan.sched.constant == 1

def window_owner(learn)->WindowOwner|None:
    "The window's owner among `learn`'s callbacks (by this declared interface), or None"
    return next((cb for cb in learn.cbs if isinstance(cb, WindowOwner)), None)

class RunningStatsPolicy:
    """Declared by a callback that decides whether training updates BatchNorm's running statistics
    (`BatchNormAccumulation`): `trained_bn_layers` finds it by this class, and so does what reads the layers training
    updates without naming BatchNorm's callback (resuming on another number of processes)"""
    def keeps_running_stats(self)->bool:
        "Does training leave the running statistics as they are ('freeze')?"; return False
    def pools_over_ranks(self)->bool:
        "In a `global_window` run, are they pooled over every rank's part of each window ('pool')?"; return False
    def window_normalises(self)->bool:
        "Is every micro-batch normalised with its whole window's statistics ('window')?"; return False

def bn_layers_with_stats(model:nn.Module)->list:
    "The BatchNorm layers (Batch Renorm's included) that keep running statistics"
    return [m for m in model.modules() if isinstance(m, BatchNormBase) and m.running_mean is not None]

def trained_bn_layers(model:nn.Module, learn=None)->list:
    """The BatchNorm layers whose running statistics training updates: in a model in training mode, those in training
    mode (a layer frozen in eval, by fastai's `BnFreeze` or by hand, keeps its statistics); in a model in eval mode
    (after fit), those training would put in training mode: all, but for what `learn`'s `BnFreeze` (a layer whose
    parameters do not train) or `BatchNormAccumulation('freeze')` freezes"""
    bns = bn_layers_with_stats(model)
    if model.training: return [bn for bn in bns if bn.training]
    if learn is None: return bns
    if any(isinstance(cb, RunningStatsPolicy) and cb.keeps_running_stats() for cb in learn.cbs): return []
    if any(isinstance(cb, BnFreeze) for cb in learn.cbs):
        return [bn for bn in bns if any(p.requires_grad for p in bn.parameters(recurse=False))
                or not list(bn.parameters(recurse=False))]
    return bns

class ResumeSignature:
    """Declared by a callback whose settings a resumed fit must match to continue exactly (`Checkpoint` names none of
    them): `resume_keys` names them, `resume_signature()` gives their values, each named where it differs at resume.
    Every declared key is in a fit's signature, None where no such callback is on the Learner"""
    resume_keys:tuple = ()
    _declared:list = []   # every class that declares (subclasses included), in import order
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ResumeSignature._declared.append(cls)
    def resume_signature(self)->dict: return {}

def resume_keys()->list:
    "Every declared key (`ResumeSignature`)"
    return list(dict.fromkeys(k for c in ResumeSignature._declared for k in c.resume_keys))

def resume_signatures(learn)->dict:
    "`{key: value}` of every declared key: the callbacks' on `learn`, None for the others"
    out = dict.fromkeys(resume_keys())
    for cb in learn.cbs:
        if isinstance(cb, ResumeSignature): out.update(cb.resume_signature())
    return out

def in_inference(learn)->bool:
    """Is `learn` inside `validate`/`get_preds`/`predict`/`tta` rather than a training `fit`? fastai sends `before_fit`
    and `after_fit` there too, holding `learn.lock`: a callback must neither set up nor raise then (a raise inside
    `validation_context` leaves the lock held, and every later `validate` on that Learner blocks forever)."""
    lock = getattr(learn, 'lock', None)
    return lock is not None and lock.locked()

class Listeners(list):
    "The functions a callback calls on one of its events (a window closed, a micro-batch undone), each added once"
    def add(self, fn):
        "Call `fn` on the event (once, however often added); returns `fn`"
        if fn not in self: self.append(fn)
        return fn
    def discard(self, fn):
        if fn in self: self.remove(fn)
    def __call__(self, *args):
        for f in list(self): f(*args)

class StopSignals:
    """Signal handlers for the length of a fit: each of `names` ('SIGTERM', 'SIGINT') calls `asked(signum)` instead of
    stopping the process at once (main thread only: Python runs handlers there); `remove()` puts the old ones back"""
    def __init__(self, names, asked):
        import signal, threading
        self.old = {}
        if not names or threading.current_thread() is not threading.main_thread(): return
        for n in names: self.old[getattr(signal, n)] = signal.signal(getattr(signal, n), lambda sig, frame: asked(sig))
    def remove(self):
        import signal
        for s,h in self.old.items(): signal.signal(s, h)
        self.old = {}

class FitGuard:
    """Wraps `learn._with_events` for the length of a `fit` (fastai looks it up for every epoch, after `before_fit`),
    acting on the epoch level only: every exception leaving an epoch, whether raised in `before_epoch`, in training,
    validation or `after_epoch` (fastai's metrics, `ShowGraphCallback`, `SaveModelCallback`, a notebook's stop button
    there), calls each registered `cleanup(exc)`; one that ends the fit without `after_fit` also removes the guard, so
    the Learner is left as it was (and still pickles)."""
    def __init__(self, learn):
        self.learn,self.orig,self.cleanups = learn,epoch_events(learn),{}
    def __call__(self, f, event_type, ex, final=lambda: None):
        if event_type != 'epoch': return self.orig(f, event_type, ex, final)
        try: return self.orig(f, event_type, ex, final)
        except BaseException as e:
            self.fail(e, remove=not isinstance(e, CANCELS))
            raise
    def fail(self, exc, remove:bool=True):
        "Every registered clean-up, now; the guard goes (`remove`) where the fit ends without `after_fit`"
        for c in list(self.cleanups.values()): c(exc)
        if remove: clear_epoch_events(self.learn)

def add_fit_guard(learn, key, cleanup):
    "Call `cleanup(exc)` when an exception leaves an epoch of this `fit`; `key` names it for `remove_fit_guard`"
    g = epoch_events(learn, own=True)
    if not isinstance(g, FitGuard): set_epoch_events(learn, g := FitGuard(learn))
    g.cleanups[key] = cleanup

def fail_fit(learn, exc):
    """`exc` ends the fit in `before_fit` (a refusal of a callback ordered after others of ours, which have set up
    already): every registered clean-up runs now and the guard goes, as if it had left an epoch"""
    g = epoch_events(learn, own=True)
    if isinstance(g, FitGuard): g.fail(exc)

def remove_fit_guard(learn, key):
    "Forget `key`'s clean-up; the guard goes once it has none"
    g = epoch_events(learn, own=True)
    if not isinstance(g, FitGuard): return
    g.cleanups.pop(key, None)
    if not g.cleanups: clear_epoch_events(learn)

# -- refusals at the start of a fit: the first of our callbacks' `before_fit` makes them, before any of ours sets up
# ------
def one_per_learner(hint:str):
    "Class decorator for our callbacks a Learner holds once (`refuse_twins`; `hint` says how to add it once)"
    def deco(cls):
        cls.one_per_learner = hint
        return cls
    return deco

def _own_class(cb):
    "The class of ours that `cb` is (or subclasses) if it is one a Learner may hold once, else None"
    return next((c for c in type(cb).__mro__ if 'one_per_learner' in c.__dict__), None)

def refuse_twins(learn):
    """A Learner holds at most one of each of our callbacks (two `GradientAccumulation`s would each skip steps and
    rescale)"""
    for c in {_own_class(cb) for cb in learn.cbs} - {None}:
        idx = [i for i,cb in enumerate(learn.cbs) if _own_class(cb) is c]
        if len(idx) > 1:
            raise ValueError(f"This Learner has {len(idx)} `{c.__name__}` callbacks (`learn.cbs` {idx}); it takes one. "
                             f"{c.one_per_learner} Remove the one you do not want: "
                             f"`learn.remove_cb(learn.cbs[{idx[-1]}])`")

def refuse_at_fit_start(learn):
    """Every refusal of every callback on `learn` (twins of ours, then each one's `refuse_fit()` in event order), made
    by the first of them to see `before_fit`, before any of them sets anything up: a refused fit leaves the Learner as
    it was (no cut loader, no wrapper, no hook), whichever of ours refuses"""
    refuse_twins(learn)
    say_fastai_accumulation(learn)
    for cb in learn.cbs.sorted('order'):   # the protocol: a callback with a `refuse_fit()`, ours or a user's
        if callable(getattr(type(cb), 'refuse_fit', None)): cb.refuse_fit()   # on the class: fastai passes names on
    for cb in learn.cbs:   # fastai's `remove_cb` of a refused `fit(cbs=[twin])` deleted the name the two shared
        if _own_class(cb) is not None and learn.__dict__.get(cb.name) is not cb: setattr(learn, cb.name, cb)

def say_fastai_accumulation(learn):
    """fastai's `GradientAccumulation` where ours is not on the Learner: the name was fastai's when the callback was
    made (`from fastai.vision.all import *` after `from accum_callback import ...` rebinds it), said before it trains
    inexactly: as the Learner is made (`FastaiAccumulationCheck`), or by the first of our callbacks to start the fit"""
    if any(isinstance(cb, WindowOwner) for cb in learn.cbs): return   # (both: `refuse_accumulation_conflicts`)
    if any(isinstance(cb, FastaiGradientAccumulation) for cb in learn.cbs):
        warnings.warn(   # (said, not refused: fastai's callback may be meant)
            "cbs holds fastai's GradientAccumulation, not accum_callback's (inexact): `from fastai.vision.all "
            "import *` after `from accum_callback import GradientAccumulation` rebinds the name to fastai's. Import "
            "accum_callback after fastai's star import, or call learn.accumulate(n_acc=...), which puts ours in its "
            "place",
            stacklevel=user_stacklevel())

class FastaiAccumulationCheck(Callback):
    """In fastai's `defaults.callbacks` once accum_callback is loaded (as fastai adds its `ProgressCallback`): each new
    Learner made with fastai's `GradientAccumulation` and none of ours is said so, then this callback leaves it (never
    pickled with it, never in `learn.cbs` after `Learner(...)` returns)"""
    def after_create(self):
        learn = self.learn
        try:
            if not any(is_ours(cb) for cb in learn.cbs if cb is not self): say_fastai_accumulation(learn)
        finally: learn.remove_cb(self)

if FastaiAccumulationCheck not in defaults.callbacks: defaults.callbacks.append(FastaiAccumulationCheck)

def is_ours(obj)->bool: return type(obj).__module__.split('.')[0] == 'accum_callback'

# where a line is not the user's: our package and the libraries it runs under (cloudpickle: fastai 2.8's `export`)
_THEIRS = tuple(os.path.dirname(os.path.abspath(sys.modules[m].__file__)) + os.sep
                for m in ('fastai', 'fastcore', 'torch', 'cloudpickle', __name__.split('.')[0]) if m in sys.modules)

def user_stacklevel()->int:
    """The `stacklevel` of a warning said from here that names the line of the user's code which led to it: the first
    caller outside accum_callback, fastai, fastcore and torch"""
    frame,level = inspect.currentframe().f_back,1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_THEIRS):
        frame,level = frame.f_back,level+1
    return level

class SaysPickled:
    """Our callbacks (the first on a Learner) say once where the Learner is pickled with them on it (`learn.export`,
    `torch.save(learn)`): the file needs accum_callback where it loads, and fastai's `load_learner` without it answers
    `UnboundLocalError`. A `deepcopy` in this process is not pickling: nothing said"""
    def __getstate__(self):
        learn = self.__dict__.get('learn')
        if learn is not None and next((cb for cb in learn.cbs if isinstance(cb, SaysPickled)), None) is self:
            say_pickled(learn)
        return super().__getstate__()

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(super().__getstate__(), memo))
        return new

def say_pickled(learn):
    ours = ', '.join(f'learn.{cb.name}' for cb in learn.cbs if is_ours(cb))
    model = learn.model if isinstance(learn.model, nn.Module) else nn.Module()
    layers = sorted({type(m).__name__ for m in model.modules() if is_ours(m)})
    fix = (f"its model holds accum_callback's {', '.join(layers)} too: load it where accum_callback is installed"
           if layers else "to load it without accum_callback, export without ours: "
                          f"`with learn.removed_cbs([{ours}]): learn.export()`")
    msg = (f"The Learner is pickled (learn.export) with accum_callback's callbacks on it: load_learner needs "
           f"accum_callback installed where it loads (without it fastai answers UnboundLocalError); {fix}")
    # fastai's `export` pickles under a blanket `simplefilter('ignore')` (for torch's notices): said through that,
    # not through a filter that names this message
    silenced = any(f[0] == 'ignore' and f[1] is not None and f[1].match(msg) for f in warnings.filters)
    with warnings.catch_warnings():
        if not silenced: warnings.simplefilter('default')
        warnings.warn(msg, stacklevel=user_stacklevel())

def refuse_accumulation_conflicts(learn):
    "What accumulation cannot run with: fastai's own callback beside it, FSDP1, CUDA graphs"
    if any(isinstance(cb, FastaiGradientAccumulation) for cb in learn.cbs):
        raise ValueError("Two gradient accumulation callbacks are on this Learner: "
                         "`accum_callback.GradientAccumulation` and fastai's "
                         "`fastai.callback.training.GradientAccumulation`; they would both rescale and skip steps. "
                         "Remove fastai's: `learn.remove_cb(fastai.callback.training.GradientAccumulation)` (or use "
                         "`learn.accumulate(...)`, which replaces it)")
    check_fsdp(learn.model)
    if compiled_with_cuda_graphs(learn.model):
        raise ValueError("The model is `torch.compile`d with CUDA graphs (mode='reduce-overhead' or 'max-autotune'): "
                         "their reused output buffers corrupt gradients accumulated over several backward passes "
                         "(PyTorch issues 96693, 181723). Compile with `mode='default'` or "
                         "`mode='max-autotune-no-cudagraphs'`")
