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
import collections, enum, io, json, math, os, pickle, re, signal, struct, tempfile, threading, time, warnings, zlib
from pathlib import Path

import torch
import torch.distributed as dist
from fastai.callback.core import Callback, CancelEpochException, CancelFitException
from fastcore.foundation import L
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.tracker import TrackerCallback
from fastai.torch_core import find_device, to_device

from .accumulate import GradientAccumulation
from .batchnorm import BatchNormAccumulation
from .compat import rng_states, set_rng_states
from .distributed import is_distributed, is_fsdp, process_count, process_rank, unwrap
from .files import atomic_write
from .guard import CANCELS, add_fit_guard, fail_fit, in_inference, refuse_at_fit_start, remove_fit_guard
from .micro import MicroBatching, stateful_modules
from .micro.loader import ReadAhead, can_skip
from .validate import whole_number
from .window import Phase, StepRecord

__all__ = ['Checkpoint', 'CheckpointError', 'UnsafeCheckpoint', 'read_checkpoint']

_MAGIC = b'ACKPT1\n'
def _callback_states(learn, skip)->list:
    """`(key, callback, get, put)` for every callback on `learn` whose state a checkpoint keeps, by the protocol: one
    with `state_dict()`/`load_state_dict()` (ours, and any user's), and fastai's trackers (`EarlyStoppingCallback`,
    `SaveModelCallback`, `ReduceLROnPlateau`: their best value and patience) through a small adapter. Keyed by the
    callback's fastai name (`#2`... for a second one of a name), so that a resumed Learner finds each by what it is"""
    out,seen = [],{}
    for cb in learn.cbs:
        if cb is skip: continue
        # (looked up on the class: a fastai callback passes unknown names on to the Learner, and it to the model)
        if callable(getattr(type(cb), 'state_dict', None)) and callable(getattr(type(cb), 'load_state_dict', None)):
            get,put = cb.state_dict,cb.load_state_dict
        elif isinstance(cb, TrackerCallback):
            get = lambda cb=cb: {k: getattr(cb, k) for k in ('best', 'wait', 'new_best') if hasattr(cb, k)}
            put = lambda d, cb=cb: cb.__dict__.update(d)
        else: continue
        name = getattr(cb, 'name', type(cb).__name__)
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f'{name}#{seen[name]}', cb, get, put))
    return out

class CheckpointError(ValueError):
    "A checkpoint that cannot be resumed exactly (what changed is named), or a damaged one"

class UnsafeCheckpoint(CheckpointError):
    "A checkpoint file that would run code when read (a planted or foreign pickle): never loaded"

def _all_reduce(values:list, op=None)->list:
    "`values` (floats) reduced over the process group (summed, or by `op`), on the device its backend needs"
    t = torch.tensor(values, dtype=torch.float32, device='cuda' if dist.get_backend() == 'nccl' else 'cpu')
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()

# -- what a checkpoint may hold: read back with `torch.load(weights_only=True)`, so that a file runs no code ------------
# Tensors, numbers, strings, bytes and plain containers go as they are; the few other types the state holds are
# written as tagged plain dicts and made again on reading: numpy arrays (numpy's RNG state) and scalars, fastcore's `L`,
# and the package's own enums and named tuples (the window's phase and step records), by name from this table only.
_TAG = '__accum_callback__'
_OWN_TYPES = {f'{c.__module__}.{c.__qualname__}': c for c in (Phase, StepRecord)}

_PLAIN = (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)

def _plain_state(o, where:str='state'):
    "`o` as types `torch.load(weights_only=True)` reads; `CheckpointError` naming what cannot be"
    import numpy as np
    from fastcore.foundation import L
    if o is None or type(o) in _PLAIN: return o
    name = f'{type(o).__module__}.{type(o).__qualname__}'
    if isinstance(o, torch.Tensor):
        if type(o) in (torch.Tensor, torch.nn.Parameter): return o.detach()
        if hasattr(o, 'to_local') and hasattr(o, 'device_mesh'):   # a DTensor (FSDP2's optimizer state): this rank's shard,
            return {_TAG: 'shard', 'value': o.to_local().detach()}   # made a DTensor again like its parameter (`_reshard`)
        # fastai's typed tensors (a batch read ahead: TensorImage, TensorCategory...): the data, and the type by name
        if _fastai_tensor(name) is None:
            raise CheckpointError(f"Checkpoint: {where} is a {name}, a tensor subclass a checkpoint read without running "
                                  "code cannot hold: give a plain tensor")
        return {_TAG: 'tensor', 'type': name, 'value': o.detach().as_subclass(torch.Tensor)}
    if name in _OWN_TYPES:
        if isinstance(o, enum.Enum): return {_TAG: 'enum', 'type': name, 'value': o.value}
        return {_TAG: 'tuple', 'type': name, 'value': [_plain_state(v, where) for v in o]}
    if isinstance(o, np.ndarray): return {_TAG: 'ndarray', 'dtype': str(o.dtype), 'shape': list(o.shape), 'value': o.ravel().tolist()}
    if isinstance(o, np.generic): return o.item()
    if isinstance(o, L): return {_TAG: 'L', 'value': [_plain_state(v, where) for v in o]}
    if type(o) in (list, tuple): return type(o)(_plain_state(v, f'{where}[{i}]') for i,v in enumerate(o))
    if type(o) in (dict, collections.OrderedDict):
        if _TAG in o: raise CheckpointError(f"Checkpoint: {where} holds the key {_TAG!r}, which the checkpoint format reserves")
        return type(o)((k, _plain_state(v, f'{where}[{k!r}]')) for k,v in o.items())
    if isinstance(o, (bool, int, float, str)) and not isinstance(o, enum.Enum):   # a subclass: its plain value
        return next(t for t in (bool, int, float, str) if isinstance(o, t))(o)
    raise CheckpointError(f"Checkpoint: {where} holds a {name}, which a checkpoint read without running code cannot hold: "
                          "give numbers, strings, tensors, lists, tuples and dicts (a callback's `state_dict()` included)")

class _Shard(torch.Tensor):
    "A DTensor's local shard as read from a checkpoint, until `_reshard` makes it a DTensor like its parameter"

def _reshard(state, param):
    "The optimizer `state` of `param` (a dict, list or tensor) with every `_Shard` a DTensor laid out as `param`"
    if isinstance(state, _Shard):
        t = state.as_subclass(torch.Tensor)
        if not hasattr(param, 'device_mesh'): return t
        return type(param).from_local(t.to(param.to_local().device), param.device_mesh, param.placements,
                                      run_check=False, shape=param.shape, stride=param.stride())
    if isinstance(state, dict): return type(state)((k, _reshard(v, param)) for k,v in state.items())
    if type(state) in (list, tuple): return type(state)(_reshard(v, param) for v in state)
    return state

def _fastai_tensor(name):
    "fastai's tensor class of that full name (`fastai.torch_core.TensorBase` and its subclasses in fastai), or None"
    import sys
    from fastai.torch_core import TensorBase
    if not isinstance(name, str) or not name.startswith('fastai.'): return None
    mod,_,cls = name.rpartition('.')
    c = getattr(sys.modules.get(mod), cls, None)   # (a module fastai has loaded: nothing is imported by name)
    return c if isinstance(c, type) and issubclass(c, TensorBase) else None

def _from_plain(o):
    "What `_plain_state` wrote, made again"
    import numpy as np
    from fastcore.foundation import L
    if isinstance(o, dict):
        tag = o.get(_TAG)
        if tag is None: return type(o)((k, _from_plain(v)) for k,v in o.items())
        if tag == 'ndarray': return np.array(o['value'], dtype=np.dtype(o['dtype'])).reshape(o['shape'])
        if tag == 'L': return L([_from_plain(v) for v in o['value']])
        if tag == 'shard': return o['value'].as_subclass(_Shard)
        if tag == 'tensor':
            cls = _fastai_tensor(o.get('type'))
            if cls is None: raise CheckpointError(f"a checkpoint names a tensor type that is not fastai's: {o.get('type')!r}")
            return o['value'].as_subclass(cls)
        cls = _OWN_TYPES.get(o.get('type'))
        if cls is None: raise CheckpointError(f"a checkpoint names a type the package does not own: {o.get('type')!r}")
        return cls(o['value']) if tag == 'enum' else cls(*[_from_plain(v) for v in o['value']])
    if isinstance(o, (list, tuple)) and type(o) in (list, tuple): return type(o)(_from_plain(v) for v in o)
    return o

def _write(path:Path, obj):
    buf = io.BytesIO(); torch.save(_plain_state(obj), buf); data = buf.getvalue()
    with atomic_write(path) as f: f.write(_MAGIC + struct.pack('<IQ', zlib.crc32(data), len(data))); f.write(data)
    return len(data)

def _unsupported(e)->str:
    "The line of torch's refusal that names what the file asked for"
    lines = [l.strip() for l in str(e).splitlines() if 'Unsupported' in l or 'WeightsUnpickler' in l]
    return (lines[0] if lines else str(e).splitlines()[0])[:240]

def read_checkpoint(path)->dict:
    "The contents of one checkpoint file, checked (its length and CRC-32); `CheckpointError` if it is cut or damaged"
    raw = Path(path).read_bytes()
    h = len(_MAGIC) + 12
    if not raw.startswith(_MAGIC) or len(raw) < h: raise CheckpointError(f"{path}: not a checkpoint, or cut short")
    crc,n = struct.unpack('<IQ', raw[len(_MAGIC):h])
    data = raw[h:]
    if len(data) != n: raise CheckpointError(f"{path}: cut short ({len(data)} of {n} bytes)")
    if zlib.crc32(data) != crc: raise CheckpointError(f"{path}: damaged (CRC-32 differs)")
    try: st = torch.load(io.BytesIO(data), map_location='cpu', weights_only=True)   # (runs no code: see `_plain_state`)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(f"{path}: refused, not read: it holds objects other than tensors, numbers, strings and "
                               f"containers, which loading would run as code ({_unsupported(e)})") from None
    return _from_plain(st)

def _loaders(dl)->list:
    "The training loader and the loaders it wraps (`DistributedDL`'s), outermost first"
    out,seen = [],set()
    while dl is not None and id(dl) not in seen:
        seen.add(id(dl)); out.append(dl)
        dl = dl.__dict__.get('dl') if hasattr(dl, '__dict__') else None
    return out

def _loader_rngs(dl)->list: return [l.rng.getstate() if hasattr(l, 'rng') and hasattr(l.rng, 'getstate') else None for l in _loaders(dl)]
def _set_loader_rngs(dl, states:list):
    for l,s in zip(_loaders(dl), states):
        if s is not None: l.rng.setstate(s)

def _loader_orders(dl)->list:
    """The order state a loader keeps from one epoch to the next besides its RNG: fastai's `LMDataLoader` shuffles its
    texts in place (a `ReindexCollection`'s `idxs`), each epoch's order a shuffle of the last one's"""
    from fastcore.xtras import ReindexCollection
    out = []
    for l in _loaders(dl):
        items = l.__dict__.get('items') if hasattr(l, '__dict__') else None
        out.append([int(i) for i in items.idxs] if isinstance(items, ReindexCollection) else None)
    return out

def _set_loader_orders(dl, saved):
    for l,o in zip(_loaders(dl), saved or ()):
        if o is None: continue
        idxs = l.__dict__['items'].idxs   # in place: LMDataLoader's `lens` shares this very list
        for i,v in enumerate(o): idxs[i] = v
        if callable(getattr(l, 'make_chunks', None)): l.make_chunks()   # (LMDataLoader's chunks follow its order)

def _local(t): return t.to_local() if hasattr(t, 'to_local') else t

# -- the state a model carries from batch to batch -----------------------------------------------------------------------
def _carried_value(v)->bool:
    "A value a module's carried state may hold: tensors and numbers, in lists and tuples"
    if v is None or isinstance(v, (torch.Tensor, bool, int, float)): return True
    return type(v) in (list, tuple) and all(_carried_value(x) for x in v)

def carried_state(model)->dict:
    """What `model` carries from one batch to the next, by module name: what fastai's `ModelResetter` resets (AWD_LSTM's
    `hidden` and `bs`, any module with `reset()`: its attributes that are tensors or numbers), or what a module declares
    with `carried_state()` (then `load_carried_state(state)` puts it back)"""
    ok,bad = stateful_modules(model)
    names = {m: n for n,m in model.named_modules()}
    out = {}
    for m in [m for m,_ in ok] + bad:
        if callable(getattr(m, 'carried_state', None)): out[names[m]] = {'declared': m.carried_state()}
        else: out[names[m]] = {'attributes': {k: v for k,v in vars(m).items()
                                              if not k.startswith('_') and k != 'training' and _carried_value(v)}}
    return out

def load_carried_state(model, saved:dict):
    "Put back what `carried_state` took, on the device of `model`'s parameters"
    mods,dev = dict(model.named_modules()),next(iter(model.parameters()), torch.empty(0)).device
    for name,d in saved.items():
        m = mods.get(name)
        if m is None: continue
        if 'declared' in d: m.load_carried_state(d['declared'])
        else:
            for k,v in d['attributes'].items(): setattr(m, k, to_device(v, dev))
def _restore_recorder(rec, saved:dict):
    "The Recorder's history and running training metrics as `Checkpoint._snapshot` saved them"
    for k,v in saved.items():
        if k not in ('smooth', 'mets'): setattr(rec, k, v)
    rec.smooth_loss.__dict__.update(saved['smooth'])
    for m,d in zip(getattr(rec, '_train_mets', []), saved['mets']): m.__dict__.update(d)

def _plain(obj)->dict:
    "A metric's running totals (numbers and tensors; not the function it calls, which may hold the Learner)"
    return {k: v for k,v in obj.__dict__.items() if isinstance(v, (int, float, bool, torch.Tensor, type(None)))}

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
    def _file(self, serial:int, rank:int)->Path: return self.folder/f'ckpt-{serial:06d}.rank{rank}.pt'
    def _serials(self)->list:
        found = set()
        for f in self.folder.glob('ckpt-*.rank*.pt'):
            m = re.fullmatch(r'ckpt-(\d+)\.rank(\d+)\.pt', f.name)
            if m: found.add(int(m.group(1)))
        return sorted(found)

    # -- fit ------------------------------------------------------------------------------------------------------
    def refuse_fit(self):
        "The folder is checked when the fit starts (`guard.refuse_at_fit_start`): a folder, and one this process can write in"
        if in_inference(self.learn) or any(type(cb).__name__ == 'LRFinder' for cb in self.learn.cbs): return
        folder = self.folder
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"Checkpoint: `path` {folder} is a file, not a folder: give a folder for the checkpoints "
                             "(it is created if missing)")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd,probe = tempfile.mkstemp(dir=folder, prefix='.write-check.', suffix='.part')
            os.close(fd); os.remove(probe)
        except OSError as e:
            raise ValueError(f"Checkpoint: cannot write in `path` {folder} ({type(e).__name__}: {e.strerror or e}): give "
                             "a folder this process can write to") from None
        # every callback's state as a checkpoint can hold it (refused now, naming it, not at the first save)
        _plain_state({k: get() for k,_,get,_ in _callback_states(self.learn, self)}, "state['callbacks']")

    def before_fit(self):
        # `lr_find` is a fit of its own that puts the weights back: neither counted nor saved
        self._off = in_inference(self.learn) or any(type(cb).__name__ == 'LRFinder' for cb in self.learn.cbs)
        if self._off: return
        refuse_at_fit_start(self.learn)   # (every callback of ours, this one's folder included: before any sets up)
        self.n_fit += 1
        self._k,self._stop,self._exit,self._t0,self._last_steps,self._skip_to = 0,None,None,time.monotonic(),0,None
        self._epoch_rngs,self._pending,self._checked_steps,self._deferred = None,None,0,False
        self._opt_steps,self._step_cancelled = 0,False
        self.serial = max(self._serials(), default=0)
        self._fit_args = {}; self._fit_args = self._fit_arguments()
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
        self._epoch_rngs = _loader_rngs(self._inner(dl))   # the order of this epoch is drawn from these
        self._epoch_start = rng_states()   # (and from these, by loaders that draw from the global RNGs: LMDataLoader)
        self._epoch_orders = _loader_orders(self._inner(dl))
        self._k = 0
        if self._pending is not None: self._continue(self._pending); self._pending = None

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
        # FSDP2 holds a window's gradients unsharded inside its modules until the window's reduce-scatter: saved when it closes
        if not can_skip(self._inner(learn.dl)) or (is_fsdp(learn.model) and ga is not None and ga.window.is_open):
            self._deferred = True; return   # (a loader of ready-made batches: epoch ends only)
        self._deferred = False
        self._save('mid')
        self._after_save()

    def after_epoch(self):
        if self._off: return
        if self._skipped():   # the Recorder appended this epoch's row: its count of iterations as the checkpoint kept it
            rec,(_,iters) = self.learn.recorder,self._rows
            if self.epoch < len(iters) and rec.iters: rec.iters[-1] = iters[self.epoch]
            return
        if self.epoch_end or self._due(end=True): self._save('end'); self._after_save()

    def _due(self, end:bool=False)->bool:
        "A checkpoint now? Rules every rank reads alike, and under DDP the clock and signals agreed at window ends"
        ga = self._ga()
        steps = self._steps()
        due = ((self.every is not None and steps - self._last_steps >= self.every) or
               (self.batches is not None and self._k % self.batches == 0))
        if not is_distributed(self.learn.model):
            return due or self._stop is not None or (self.minutes is not None and time.monotonic() - self._t0 >= 60*self.minutes)
        if steps == self._checked_steps and not end: return due
        self._checked_steps = steps   # (one all-reduce a window, where the step has one anyway)
        timed = self.minutes is not None and time.monotonic() - self._t0 >= 60*self.minutes
        signalled,timed = _all_reduce([float(self._stop is not None), float(timed)])
        if signalled and self._stop is None: self._stop = signal.SIGTERM   # another rank was asked to stop: all stop
        return due or bool(signalled) or bool(timed)

    def _after_save(self):
        ga = self._ga()
        self._last_steps,self._t0 = self._steps(),time.monotonic()
        if self._stop is not None:   # asked to stop: the fit ends cleanly (every callback's `after_fit`), then the process
            self._exit,self._stop = self._stop,None
            raise CancelFitException()

    def _ga(self): return next((cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation)), None)

    def _steps(self)->int:
        "Optimizer steps of this fit: the window's count, or without accumulation the steps no callback cancelled"
        ga = self._ga()
        return ga.steps if ga is not None else self._opt_steps
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
        learn,ga = self.learn,self._ga()
        mb = next((cb for cb in learn.cbs if isinstance(cb, MicroBatching)), None)
        bna = next((cb for cb in learn.cbs if isinstance(cb, BatchNormAccumulation)), None)
        dl = learn.dls.train
        return {'fit': self.n_fit, 'n_epoch': learn.n_epoch, 'world size': process_count(),
                'window': repr(ga.sched) + f", partial={ga.partial!r}" if ga is not None else None,
                'micro_bs': (mb.mode if mb is not None else None),
                'BatchNorm mode': bna.mode if bna is not None else None,
                'training loader': f"{len(dl)} batches of {getattr(dl, 'bs', None)}",
                'model': [(k, tuple(v.shape)) for k,v in unwrap(learn.model).state_dict().items()],
                **getattr(self, '_fit_args', {})}

    def _fit_arguments(self)->dict:
        """What the fit was called with, read when it starts: the learning rate and weight decay per parameter group (as
        `fit` sets them; the momenta a previous fit's schedule left are not the fit's arguments) and every `ParamScheduler`'s schedules sampled at 0, 1/4, ... 1 of training
        (`fit_one_cycle`'s `lr_max`, `div`, `pct_start`, moms; `fit_flat_cos`, `fit_sgdr`...)"""
        from fastai.callback.schedule import ParamScheduler
        def num(v):
            try: return [num(x) for x in v] if isinstance(v, (list, tuple)) or getattr(v, 'ndim', 0) else float(v)
            except (TypeError, ValueError): return repr(v)
        learn = self.learn
        hypers = [{k: num(h[k]) for k in ('lr', 'wd') if k in h} for h in learn.opt.hypers] if learn.opt is not None else None
        scheds = {k: [num(f(p)) for p in (0., .25, .5, .75, 1.)] for cb in learn.cbs if isinstance(cb, ParamScheduler)
                  for k,f in cb.scheds.items()}
        return {'hyper-parameters': hypers, 'schedule': scheds or None}

    def _snapshot(self, where:str)->dict:   # (not `_state`: fastcore's `Stateful` unpickles a Learner's callbacks with `_state = {}`)
        learn = self.learn
        model = unwrap(learn.model)
        params = [p for p in model.parameters()]
        rec = learn.recorder
        mets = [_plain(m) for m in getattr(rec, '_train_mets', [])]
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        feed = getattr(learn.dl, 'feed', None) if where == 'mid' else None
        return dict(
            where=where, epoch=learn.epoch, k=self._k, signature=self.signature(), opt_steps=self._opt_steps,
            model={k: _local(v).clone() for k,v in model.state_dict().items()},
            grads=[None if p.grad is None else _local(p.grad).clone() for p in params],
            opt=learn.opt.state_dict() if learn.opt is not None else None,
            scaler=mp.scaler.state_dict() if mp is not None and getattr(mp, 'scaler', None) is not None else None,
            rngs=rng_states(), epoch_rngs=self._epoch_start if where == 'mid' else None,
            loader_orders=self._epoch_orders if where == 'mid' else _loader_orders(self._inner(learn.dls.train)),
            carried=carried_state(model) if where == 'mid' else None, ahead=to_device(feed.ahead, 'cpu') if feed is not None and feed.ahead is not None else None,
            ahead_device=find_device(feed.ahead) if feed is not None and feed.ahead is not None else None,
            loader_rngs=self._epoch_rngs if where == 'mid' else _loader_rngs(self._inner(learn.dls.train)),
            pct_train=getattr(learn, 'pct_train', 0.), train_iter=getattr(learn, 'train_iter', 0),
            recorder=dict({k: getattr(rec, k) for k in ('lrs', 'iters', 'losses', 'values') if hasattr(rec, k)},
                          smooth=_plain(rec.smooth_loss), mets=mets),
            callbacks={k: get() for k,_,get,_ in _callback_states(learn, self)})

    def _save(self, where:str):
        self.serial += 1
        f = self._file(self.serial, process_rank())
        try: _write(f, self._snapshot(where)); ok = True
        except OSError as e:   # a full disk, a folder made read-only: said, and training goes on (the next one tries again)
            ok = False
            last = self._file(self.saved[-1], process_rank()) if self.saved else None
            warnings.warn(f"Checkpoint: could not write {f} ({type(e).__name__}: {e}); training goes on, the last good "
                          f"checkpoint is {last or 'none yet'}, the next one due tries again", stacklevel=2)
        if process_count() > 1: dist.barrier()   # (a checkpoint counts once every rank wrote its file)
        if not ok: return
        self.saved.append(self.serial)
        for s in self._serials()[:-self.keep]:
            try: self._file(s, process_rank()).unlink()
            except FileNotFoundError: pass

    # -- resuming -------------------------------------------------------------------------------------------------
    def _newest(self):
        "The newest checkpoint every rank can read whole (a cut or damaged one is passed over), or None"
        for s in reversed(self._serials()):
            try: st = read_checkpoint(self._file(s, process_rank())); ok = 1.
            except UnsafeCheckpoint as e:   # never read: said, and passed over like a damaged one
                warnings.warn(f"Checkpoint: {e}", stacklevel=2); st,ok = None,0.
            except (CheckpointError, OSError, RuntimeError, EOFError): st,ok = None,0.
            if process_count() > 1: ok = _all_reduce([ok], dist.ReduceOp.MIN)[0]
            if ok: return s,st
        return None

    def _resume(self):
        found = self._newest()
        if found is None: return
        serial,st = found
        self.resumed_from = self._file(serial, process_rank())
        sig,now = st['signature'],self.signature()
        if sig['fit'] > now['fit'] or (sig['fit'] == now['fit'] and st['where'] == 'done'):   # this fit finished before the cut
            if sig['fit'] == now['fit']:
                self._refuse_changes(sig, now)   # (a finished fit rerun with other arguments: refused, not returned)
                self._load(st)
            self._skip_epochs(self.learn.n_epoch)
            warnings.warn(f"Checkpoint: this fit finished before ({self.resumed_from}): nothing is trained, the model is "
                          "as it ended; Checkpoint(resume=False) or another `path` trains it again", stacklevel=2)
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
        what = '; '.join(f"{k}: {old[k]!r} then, {new[k]!r} now" for k in changed)
        if self.strict:
            raise CheckpointError(f"Checkpoint: cannot resume {self.resumed_from} exactly, {what}. Run the fit as it was, "
                                  "start afresh with Checkpoint(..., resume=False), or accept it with strict=False")
        import warnings
        warnings.warn(f"Checkpoint: resuming {self.resumed_from} with {what} (strict=False): not the run it would have been")

    def _load(self, st:dict):
        learn = self.learn
        model = unwrap(learn.model)
        with torch.no_grad():
            sd = model.state_dict()
            for k,v in st['model'].items(): _local(sd[k]).copy_(v)
            for p,g in zip(model.parameters(), st['grads']):
                if g is None: p.grad = None
                elif p.grad is None: p.grad = g.to(_local(p).device) if not hasattr(p, 'to_local') else None
                else: _local(p.grad).copy_(g)
        if st['opt'] is not None and learn.opt is not None:
            ps = [p for p,*_ in learn.opt.all_params(with_grad=False)]
            if len(ps) == len(st['opt'].get('state', ())):   # (FSDP2: each parameter's state as its DTensor again)
                st['opt']['state'] = [_reshard(s_, p) for s_,p in zip(st['opt']['state'], ps)]
            learn.opt.load_state_dict(st['opt'])
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        if st['scaler'] is not None and mp is not None and getattr(mp, 'scaler', None) is not None: mp.scaler.load_state_dict(st['scaler'])
        _restore_recorder(learn.recorder, st['recorder'])
        for k,_,_,put in _callback_states(learn, self):
            if k in st['callbacks']: put(st['callbacks'][k])
        learn.epoch,learn.pct_train,learn.train_iter = st['epoch'],st['pct_train'],st['train_iter']
        self._opt_steps = self._last_steps = st.get('opt_steps', 0)
        if st['where'] != 'mid':
            set_rng_states(st['rngs'])
            _set_loader_rngs(self._inner(learn.dls.train), st['loader_rngs'])
            _set_loader_orders(self._inner(learn.dls.train), st.get('loader_orders'))

    def _continue(self, st:dict):
        "The epoch the checkpoint was taken in starts: its order, the batches done skipped unloaded, the RNGs as they were"
        learn = self.learn
        inner = self._inner(learn.dl)
        _set_loader_rngs(inner, st['loader_rngs'])
        _set_loader_orders(inner, st.get('loader_orders'))
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
        self._k = st['k']
        # (fastai's `before_train` set these for the epoch's start after `_load`: its place in the epoch again)
        learn.pct_train,learn.train_iter = st['pct_train'],st['train_iter']
        _restore_recorder(learn.recorder, st['recorder'])

    def _skip_epochs(self, first:int):
        """Epochs before `first` are done: each is cancelled in `before_epoch` (fastai's own `SkipToEpoch` mechanism),
        so every callback sees its events (the progress bar, `ShowGraphCallback`, `CSVLogger`), and the Recorder logs
        the row the checkpoint kept for it"""
        self._skip_to = first
        rec = self.learn.recorder
        self._rows = list(getattr(rec, 'values', [])),list(getattr(rec, 'iters', []))
        rec.values,rec.iters = [],[]   # (appended again, epoch by epoch, as the skipped epochs end)

    def before_epoch(self):
        if getattr(self, '_off', True) or self._skip_to is None or self.epoch >= self._skip_to: return
        values,_ = self._rows
        if self.epoch < len(values): self.learn.recorder.log = L([self.epoch]) + L(values[self.epoch])
        raise CancelEpochException()

    def _skipped(self)->bool: return self._skip_to is not None and self.epoch < self._skip_to
