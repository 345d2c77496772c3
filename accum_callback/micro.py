"""Micro-batching for `GradientAccumulation(micro_bs=...)`: loader batches cut into micro-batches, the out-of-memory retry
(snapshot, undo, the same samples again smaller), the size probe, inference batches cut under 'auto', and the per-row
state of models that carry it from one batch to the next.

`GradientAccumulation` owns one `MicroBatcher` and calls it from its events; the window (what a step is) stays in
`accumulate.py`, what the ranks agree on in `distributed.py`."""
from __future__ import annotations
import copy, functools, gc, random, warnings
from numbers import Integral

import torch, torch.nn as nn
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.fp16 import MixedPrecision
from fastai.torch_core import find_bs

from .compat import BatchNormBase, OutOfMemoryError, autocast_enabled, foreach, tree_flatten, tree_unflatten
from .distributed import is_ddp, is_distributed, is_fsdp, sum_over_ranks, unwrap
from .losses import loss_items, loss_reduction

__all__ = ['copy_module', 'MicroBatcher', 'MicroBatches', 'RowStates', 'is_out_of_memory', 'stateful_modules', 'StatefulModelError', 'piece_bounds',
           'slice_batch', 'cat_outputs']

_OOM_TEXTS = ('out of memory', 'CUBLAS_STATUS_ALLOC_FAILED', 'CUDNN_STATUS_ALLOC_FAILED', 'CUDNN_STATUS_NOT_SUPPORTED',
              'canUse32BitIndexMath')   # cuDNN/cuBLAS's ways of saying a batch is too large for the device

def is_out_of_memory(e:BaseException)->bool:
    "Does `e` say the micro-batch did not fit: `torch.OutOfMemoryError`, or a RuntimeError that means the same"
    if isinstance(e, OutOfMemoryError): return True
    return isinstance(e, RuntimeError) and any(t in str(e) for t in _OOM_TEXTS)

def _cut(s:int, n:int, size:int, nom=None)->tuple:
    """The end of the piece that starts at item `s` of `n`, and the `nom` for the next piece: the items left are cut into
    `ceil(left/size)` near-equal pieces, counted on `nom` instead of the items left where given (under DDP: the loader's
    batch size less `size` per piece cut, so that a rank's short batch is cut into as many pieces as the others')"""
    left = n-s
    e = s + -(-left//max(1, -(-(left if nom is None else nom)//size)))
    return e,(None if nom is None else max(nom-size, 1))

def piece_bounds(n:int, size:int)->list:
    "`(start, end)` of the near-equal pieces `micro_bs=size` cuts `n` items into: `ceil(n/size)` pieces, none larger than `size`"
    out,s = [],0
    while s < n: e,_ = _cut(s, n, size); out.append((s, e)); s = e
    return out

def _first_line(e:BaseException)->str: return str(e).splitlines()[0][:200] if str(e) else type(e).__name__

def slice_batch(b, s:int, e:int):
    "Items `s:e` of a batch: tensors sliced along their first dimension, tuples and lists element by element"
    if isinstance(b, torch.Tensor): return b[s:e]
    if isinstance(b, (tuple, list)): return type(b)(slice_batch(o, s, e) for o in b)
    raise TypeError(f"GradientAccumulation(micro_bs=...) cannot split a batch element of type {type(b).__name__}: "
                    "only tensors and tuples/lists of them (give the loader micro-batches instead, with `n_step`)")

def cat_outputs(outs:list):
    "The model outputs of consecutive pieces of a batch joined along the first dimension (tensors, tuples, lists, dicts)"
    o = outs[0]
    if isinstance(o, torch.Tensor):
        if o.ndim == 0: raise TypeError("the model returns a 0-d tensor: its output cannot be joined over micro-batches")
        return torch.cat(outs)
    if isinstance(o, (tuple, list)): return type(o)(cat_outputs(list(z)) for z in zip(*outs))
    if isinstance(o, dict): return type(o)((k, cat_outputs([d[k] for d in outs])) for k in o)
    if o is None: return None
    raise TypeError(f"the model returns a {type(o).__name__}: only tensors, tuples, lists and dicts of them can be joined "
                    "over micro-batches")

# -- models that carry state from one batch to the next ------------------------------------------------------------------
def _computed_tensors(model:nn.Module, depth:int=3):
    """Tensors computed in a forward (not graph leaves) that the modules keep as attributes, inside lists, tuples and dicts
    too, or that objects they hold keep (fastai's `Hook.stored`, in a U-Net's blocks), up to `depth` objects away"""
    seen,level = set(),[vars(m) for m in model.modules()]
    for _ in range(depth):
        nxt = []
        for d in level:
            for t in tree_flatten(d)[0]:
                if isinstance(t, torch.Tensor):
                    if not t.is_leaf: yield t
                elif not isinstance(t, (nn.Module, type)) and isinstance(getattr(t, '__dict__', None), dict) and id(t) not in seen:
                    seen.add(id(t)); nxt.append(vars(t))
        level = nxt

def copy_module(model:nn.Module, memo:dict|None=None, computed=lambda t: t.detach().clone())->nn.Module:
    """`copy.deepcopy(model)`, also for models that keep a tensor computed at each forward (fastai's `WeightDropout` in
    AWD_LSTM, torch's old `weight_norm`, the hooks of fastai's U-Net), which deepcopy refuses: the copy holds
    `computed(t)` for each (by default detached; the model computes it again at its next forward). `memo` as
    `copy.deepcopy`'s."""
    memo = {} if memo is None else memo
    for t in _computed_tensors(model):
        if id(t) not in memo: memo[id(t)] = computed(t)
    return copy.deepcopy(model, memo)

class StatefulModelError(ValueError):
    "A model carries state between batches in a way `micro_bs` cannot split per row"

def _flat(state)->tuple[list,object]:
    "The tensors of a batch state (a tensor, or tuples/lists of them) and how to put them back together"
    leaves,spec = tree_flatten(state)
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        raise TypeError("a batch state must be a tensor or tuples/lists of tensors, got " + ', '.join(sorted({type(t).__name__ for t in leaves})))
    return leaves,spec

def _unflat(leaves, spec):
    return tree_unflatten(list(leaves), spec)

class _AWDState:
    "fastai's AWD_LSTM (and AWD_QRNN): `hidden`, one (h, c) per layer with the rows in dimension 1, and `bs`"
    dim = 1
    @staticmethod
    def get(m, bs:int):
        if m.bs != bs: m._change_hidden(bs)   # fastai's own rule: keep the first rows, or add rows of zeros
        return m.hidden
    @staticmethod
    def set(m, state, bs:int): m.hidden,m.bs = state,bs
    @staticmethod
    def current(m, bs:int): return m.hidden

class _ProtocolState:
    "A module of the user's: `get_batch_state(bs)`, `set_batch_state(state)`, `batch_state_dim` (default 0)"
    def __init__(self, m): self.dim = getattr(m, 'batch_state_dim', 0)
    @staticmethod
    def get(m, bs:int): return m.get_batch_state(bs)
    @staticmethod
    def set(m, state, bs:int): m.set_batch_state(state)
    @staticmethod
    def current(m, bs:int): return m.get_batch_state(bs)

def _known_stateless(m)->bool:
    "Modules with a `reset` that hold no state between batches of their own (containers, weight-dropout)"
    names = {'SequentialRNN', 'WeightDropout', 'EmbeddingDropout', 'RNNDropout'}
    return type(m).__name__ in names and type(m).__module__.startswith('fastai.')

def _holds_no_state(m)->bool:
    """Nothing inside `m` carries state from one batch to the next: it says so (`carries_batch_state = False`), or it
    resets what it wraps at every forward, as fastai's `SentenceEncoder` (a text classifier's encoder) does"""
    if getattr(m, 'carries_batch_state', None) is False: return True
    return type(m).__name__ == 'SentenceEncoder' and type(m).__module__.startswith('fastai.')

def stateful_modules(model:nn.Module)->tuple[list, list]:
    """`(splittable, unsplittable)`: the modules of `model` that carry state from one batch to the next. Splittable: fastai's
    `AWD_LSTM`/`AWD_QRNN`, and any module with `get_batch_state(bs)` and `set_batch_state(state)`. Unsplittable: any other
    module with a `reset()` method (fastai's sign of a model with state; `ModelResetter` calls it). Not counted: what sits
    inside a module that holds no state (`carries_batch_state = False`, or fastai's `SentenceEncoder`, which resets its
    AWD_LSTM at every forward), and modules inside a splittable one (its own business)."""
    model = unwrap(model)
    ok,bad,skip = [],[],set()
    for m in model.modules():
        if id(m) in skip: continue
        if _holds_no_state(m): skip.update(id(c) for c in m.modules()); continue
        if callable(getattr(m, 'get_batch_state', None)) and callable(getattr(m, 'set_batch_state', None)): a = _ProtocolState(m)
        elif type(m).__name__ in ('AWD_LSTM', 'AWD_QRNN') and hasattr(m, 'hidden') and hasattr(m, '_change_hidden'): a = _AWDState
        elif callable(getattr(m, 'reset', None)) and not _known_stateless(m): bad.append(m); continue
        else: continue
        ok.append((m, a))
        skip.update(id(c) for c in m.modules())
    return ok,bad

def refuse_stateful(bad:list, model:nn.Module):
    names = ', '.join(sorted({type(m).__name__ for m in bad}))
    raise StatefulModelError(
        f"GradientAccumulation(micro_bs=...): the model carries state from one batch to the next ({names} has `reset()`), "
        "and each micro-batch would start from another micro-batch's rows. Give the module `get_batch_state(bs)` and "
        "`set_batch_state(state)` (see docs/micro_batching.md: rows along `batch_state_dim`), set "
        "`carries_batch_state = False` on it if it holds no state between batches, or feed the loader micro-batches "
        "and accumulate with `n_step` instead of `micro_bs`")

class RowStates:
    """The per-row state of a batch cut into pieces: each piece starts from its own rows of the state the whole batch
    would start from, and what it leaves is written back into those rows; after the last piece the module holds the
    state of the whole batch, as if it had not been cut. A piece run again (out-of-memory retry) starts from the same rows.

    A `reset()` of a module while its batch is cut (a callback that resets the state before every batch, which fastai
    calls for every piece) is respected: the rows of the pieces from then on start from the state the reset left, as
    the whole batch would after a reset before it (`watch` wraps the modules' `reset` for the length of a fit)."""
    def __init__(self, mods:list): self.mods,self.n,self.s_in,self.s_out,self.piece = mods,None,None,None,None
    def __bool__(self): return bool(self.mods)
    def begin(self, n:int):
        self.n = n
        self.s_in = [_flat(a.get(m, n)) for m,a in self.mods]
        self.s_out = [[t.clone() for t in leaves] for leaves,_ in self.s_in]
    def _set_rows(self, i:int, s:int, e:int):
        (m,a),(leaves,spec) = self.mods[i],self.s_in[i]
        a.set(m, _unflat([t.narrow(a.dim, s, e-s).clone() for t in leaves], spec), e-s)
    def enter(self, s:int, e:int):
        if self.n is None: return
        self.piece = (s, e)
        for i in range(len(self.mods)): self._set_rows(i, s, e)
    def leave(self, s:int, e:int):
        if self.n is None: return
        self.piece = None
        for (m,a),out in zip(self.mods, self.s_out):
            for i,t in enumerate(_flat(a.current(m, e-s))[0]):
                if out[i].dtype != t.dtype or out[i].device != t.device: out[i] = out[i].to(t)   # e.g. zeros of the default dtype
                out[i].narrow(a.dim, s, e-s).copy_(t.detach())
    def end(self):
        if self.n is None: return
        for (m,a),out,(_,spec) in zip(self.mods, self.s_out, self.s_in): a.set(m, _unflat(out, spec), self.n)
        self.n = self.s_in = self.s_out = self.piece = None

    # -- a reset while a batch is cut ------------------------------------------------------------------------------
    def _reset(self, i:int, orig, *args, **kwargs):
        res = orig(*args, **kwargs)
        if self.n is not None:   # the rows still to run start from the reset state, for every piece
            (m,a) = self.mods[i]
            self.s_in[i] = _flat(a.get(m, self.n))
            if self.piece is not None: self._set_rows(i, *self.piece)   # reset inside a piece: it runs from its rows of it
        return res
    def watch(self):
        "Wrap each module's `reset` (an instance attribute, removed by `unwatch`)"
        for i,(m,_) in enumerate(self.mods):
            orig = getattr(m, 'reset', None)
            if callable(orig) and 'reset' not in m.__dict__: m.__dict__['reset'] = functools.partial(self._reset, i, orig)
    def unwatch(self):
        for m,_ in self.mods:
            f = m.__dict__.get('reset')
            if isinstance(f, functools.partial) and getattr(f.func, '__self__', None) is self: del m.__dict__['reset']

# -- the training loader, cut -----------------------------------------------------------------------------------------------
class MicroBatches:
    """The training loader with each of its batches cut into `ceil(n / micro_bs)` near-equal micro-batches (none larger
    than `micro_bs`, none needlessly small: a BatchNorm layer cannot train on one item), read by fastai's loop in place
    of `learn.dl` during the training phase. Everything else is the real loader's (`bs`, `device`, `dataset`, ...). After
    an out-of-memory error `retry` makes it cut the same samples again, at the size in force then.

    What the window needs of the piece being run: `serial` (which loader batch), `batch_index`, `batch_n` (its items),
    `start`/`end` (the piece's rows), `last_chunk` (the batch's last piece), `last_batch` (the epoch's last batch)."""
    def __init__(self, dl, mb:MicroBatcher):
        self.dl,self.mb = dl,mb
        self.batch_index,self.batch_n,self.start,self.end,self.retry,self.serial = -1,0,0,0,False,0
        self.last_chunk = self.last_batch = False
        self._nom = None
    def __getattr__(self, k):
        if k in ('dl', 'mb'): raise AttributeError(k)
        return getattr(self.dl, k)
    def _sizes(self)->list:
        "The loader's batch sizes, where it says (fastai's `n`, `bs`, `drop_last`), else `bs` each"
        n,bs,nb = getattr(self.dl, 'n', None),self.dl.bs,len(self.dl)
        if n is None or not bs: return [bs or 1]*nb
        return [min(bs, n - i*bs) for i in range(nb)]
    def __len__(self)->int:
        "Micro-batches this epoch at the size in force (fastai's `n_iter` and progress bar read it)"
        m = self.mb.size
        return sum(-(-b//m) for b in self._sizes()) if m else len(self.dl)
    def pieces_left(self)->int:
        "Micro-batches still to run this epoch at the size in force, the one being (re)run included"
        m,sizes = self.mb.size,self._sizes()
        rest = sum(-(-b//m) for b in sizes[self.batch_index+1:]) if m else len(sizes)-self.batch_index-1
        if self.batch_index < 0: return rest
        k,s,nom = 0,self.start,self._nom
        while s < self.batch_n: s,nom = _cut(s, self.batch_n, m, nom); k += 1
        return rest + k
    def __iter__(self):
        nb,bs,mb = len(self.dl),self.dl.bs,self.mb
        for bi,b in enumerate(self.dl):
            n = find_bs(b)
            self.batch_index,self.batch_n,self.start,self.last_batch = bi,n,0,bi == nb-1
            # under DDP/FSDP2 every rank cuts as many pieces (fastai's Recorder gathers each; FSDP2's collectives match)
            self._nom = bs if (is_distributed(mb.learn.model) and bs) else None
            self.serial = mb.batch_started(n)
            if mb.rows: mb.rows.begin(n)   # a stateful model: the state this batch starts from, per row
            while self.start < n:
                self.end,nom = _cut(self.start, n, mb.size, self._nom)
                self.last_chunk = self.end == n
                yield slice_batch(b, self.start, self.end) if (self.start, self.end) != (0, n) else b
                if self.retry: self.retry = False   # the same samples again, at the size in force now
                else: self.start,self._nom = self.end,nom
            if mb.rows: mb.rows.end()
            mb.batch_done(n)
        self.batch_index = nb

# -- the one_batch wrapper of micro_bs='auto' ----------------------------------------------------------------------------------
class _PeerOutOfMemory(Exception):
    "Another DDP rank ran out of memory in this micro-batch: this rank undoes it too, and every rank retries smaller"

class _OneBatch:
    """`learn.one_batch` under `micro_bs='auto'`. Training: a micro-batch that runs out of memory is undone and retried
    smaller (under DDP every rank agrees after each micro-batch). Inference (validation, `get_preds`, `predict`, `tta`):
    the model's forward is cut into pieces when a batch runs out of memory, and the events see the whole batch."""
    def __init__(self, learn, mb:MicroBatcher): self.learn,self.mb,self.orig = learn,mb,learn.one_batch
    def __call__(self, i, b):
        mb = self.mb
        if not self.learn.training: return mb.infer_one_batch(self.orig, i, b)
        mb.agreed,mb.snap = False,mb.snapshot()
        try: return self.orig(i, b)
        except BaseException as e:
            peer = isinstance(e, _PeerOutOfMemory)
            if not ((peer or is_out_of_memory(e)) and mb.loader is not None): raise
            msg = _first_line(e)
            e.__traceback__ = None   # its frames hold the attempt's tensors
        if not peer and mb.ranks_agree() and not mb.agreed: mb.agree(oom=True)   # the ranks that fitted wait in `after_backward`
        mb.undo()
        mb.halve(msg)

class _CutLoader(Callback):
    """Cuts the training loader into micro-batches once every callback that replaces it has (fastai's
    `DistributedTrainer`, order 11, wraps `learn.dl` in `DistributedDL` in its `before_train`: cut before it, the pieces
    were wrapped again and never cut), and before anything reads its length (the progress bar, order 60). Added by
    `GradientAccumulation` for the length of a fit"""
    order,run_valid = 12,False
    def __init__(self, mb): self.mb = mb
    def before_train(self): self.mb.start_train()

# -- the micro-batcher -------------------------------------------------------------------------------------------------------
class MicroBatcher:
    """The micro-batching of one `GradientAccumulation`: `size` is the micro-batch in use (fixed, or what 'auto' found,
    kept for the next fit), `inference_bs` the largest inference batch that fitted under 'auto' (None: batches are not
    cut), `trials` the items/s the probe measured per size.

    The window tells it what an undo must put back through `window_state`/`restore_window` (callables), and listens to
    undone micro-batches through `on_undo`; `clock` and `on_gpu` time the probe."""
    def __init__(self, mode, probe:bool, window_state, restore_window, clock, on_gpu):
        self.mode,self.probe_on = mode,probe
        self.size = mode if isinstance(mode, Integral) else None
        self.inference_bs,self.trials = None,{}
        self.window_state,self.restore_window,self.clock,self.on_gpu = window_state,restore_window,clock,on_gpu
        self.learn,self.loader,self.rows,self.undo_listeners = None,None,RowStates([]),[]
        self._probe,self._serial,self._state = None,0,None
        self.agreed,self.snap = False,None

    @property
    def auto(self)->bool: return self.mode == 'auto'

    # -- fit -----------------------------------------------------------------------------------------------------------
    def start_fit(self, learn):
        "Training starts: the model's state is checked, and under 'auto' `learn.one_batch` retries"
        self.learn = learn
        model = learn.model
        if self.auto and is_fsdp(model):
            raise ValueError("GradientAccumulation(micro_bs='auto') under FSDP2: a rank that runs out of memory in the "
                             "middle of a forward or backward leaves the others waiting in FSDP's all-gathers and "
                             "reduce-scatters, so it cannot be undone and retried. Give `micro_bs` a number (every rank "
                             "cuts its batches into the same number of pieces)")
        ok,bad = stateful_modules(model)
        if bad: refuse_stateful(bad, model)
        self.rows.unwatch()
        self.rows,self._state = RowStates(ok),None
        self.rows.watch()   # a reset while a batch is cut is respected
        if self.auto:
            if self.size is None: self.size = getattr(learn.dls.train, 'bs', None)   # or what an earlier fit found
            self._wrap_one_batch()
        if not any(isinstance(cb, _CutLoader) for cb in learn.cbs): learn.add_cb(_CutLoader(self))
    def _wrap_one_batch(self):
        if not isinstance(self.learn.__dict__.get('one_batch'), _OneBatch): self.learn.one_batch = _OneBatch(self.learn, self)
    def _unwrap_one_batch(self):
        if self.learn is not None and isinstance(self.learn.__dict__.get('one_batch'), _OneBatch): del self.learn.__dict__['one_batch']
    def unhook(self):
        "The fit or inference is over (or left by an exception): `learn.one_batch` and `learn.dl` are fastai's again"
        learn = self.learn
        if learn is None: return
        self._unwrap_one_batch()
        self.end_train()
        learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, _CutLoader)])
        self.rows.unwatch()
        self._state,self.snap = None,None

    def start_train(self):
        self.loader = self.learn.dl = MicroBatches(self.learn.dl, self)
    def end_train(self):
        if self.loader is not None: self.learn.dl,self.loader = self.loader.dl,None
        if self.rows: self.rows.n = None

    def start_inference(self, learn):
        "`validate`/`get_preds`/`predict`/`tta` under 'auto': batches that run out of memory are cut"
        if not self.auto: return
        self.learn = learn
        self._wrap_one_batch()
    def end_inference(self): self._unwrap_one_batch()

    # -- per loader batch / micro-batch -----------------------------------------------------------------------------------
    def ranks_agree(self)->bool: "'auto' under DDP: the ranks agree after every micro-batch"; return self.auto and is_ddp(self.learn.model)
    def batch_started(self, n:int)->int:
        self._serial += 1
        if self.size is None: self.size = n
        p = self._probe
        if p is not None and p['stage'] in ('time_a', 'time_b'): p['t0'] = self.clock()
        return self._serial
    def batch_done(self, n:int):
        "'auto' on a GPU, outside DDP: once a size has run a loader batch, time it and the next smaller; keep the faster"
        if not (self.auto and self.probe_on) or is_distributed(self.learn.model) or not self.on_gpu(): return
        p = self._probe
        if p is None: self._probe = dict(stage='time_a' if self.size >= 2 else 'done', size=self.size); return
        if p['stage'] == 'time_a':
            p['rate_a'] = n/(self.clock()-p['t0'])
            self.trials[p['size']] = p['rate_a']
            self.size,p['stage'] = p['size']//2,'warm_b'
            self._resize_epoch()
        elif p['stage'] == 'warm_b': p['stage'] = 'time_b'   # cuDNN picks its algorithms for the new shapes first
        elif p['stage'] == 'time_b':
            rate = n/(self.clock()-p['t0'])
            small = p['size']//2
            self.trials[small] = rate
            self.size = small if rate > p['rate_a'] else p['size']
            p['stage'] = 'done'
            if self.size == small:
                warnings.warn(f"GradientAccumulation: micro-batch {small} ran at {rate:.0f} items/s against {p['size']}'s "
                              f"{p['rate_a']:.0f}: micro_bs is now {small}", stacklevel=2)
            else: self._resize_epoch()

    def before_forward(self):
        "The micro-batch's rows of a stateful model's state (training)"
        sp = self.loader
        if sp is not None and self.rows.n is not None: self.rows.enter(sp.start, sp.end)
    def after_forward(self):
        sp = self.loader
        if sp is not None and self.rows.n is not None: self.rows.leave(sp.start, sp.end)

    def progress(self)->float|None:
        "How far through the epoch's loader batches the micro-batch just run is (None: no loader cut)"
        sp = self.loader
        if sp is None or not sp.batch_n: return None
        return (sp.batch_index + sp.end/sp.batch_n)/len(sp.dl)

    def _resize_epoch(self):
        "The size changed mid-epoch: fastai's `n_iter` (schedules, ShortEpochCallback) and the progress bar follow it"
        learn,sp = self.learn,self.loader
        if sp is None or not getattr(learn, 'training', False): return
        n = getattr(learn, 'iter', -1) + 1 + sp.pieces_left()
        learn.n_iter = n
        pbar = getattr(getattr(learn, 'progress', None), 'pbar', None)
        if pbar is not None and getattr(pbar, 'total', None) is not None: pbar.total = n

    # -- DDP agreement (micro_bs='auto') ----------------------------------------------------------------------------------
    def agree(self, oom:bool=False, cancelled:bool=False)->tuple[bool,bool]:
        "Did any rank run out of memory, did any rank cancel this micro-batch before its backward? (one small all-reduce)"
        self.agreed = True
        a,b = sum_over_ranks([float(oom), float(cancelled)], self.learn.model)
        return a > 0,b > 0

    def after_backward(self, counted:bool):
        """Every rank comes here or to `after_cancel_batch` once per micro-batch. A peer out of memory: undo and retry
        smaller with it. A peer's callback cancelled the micro-batch before its backward: undo it here too and cancel,
        so that every rank drops the same micro-batch and no collective waits"""
        if not self.ranks_agree() or self.agreed: return
        oom,cancelled = self.agree(cancelled=not counted)
        if oom: raise _PeerOutOfMemory('another rank ran out of memory in this micro-batch')
        if cancelled and counted:
            self.undo(drop=False)
            raise CancelBatchException()
    def after_cancel_batch(self):
        if not self.ranks_agree() or self.agreed: return
        oom,_ = self.agree(cancelled=True)
        if oom: raise _PeerOutOfMemory('another rank ran out of memory in this micro-batch')

    # -- snapshot and undo ------------------------------------------------------------------------------------------------
    def _state_tensors(self)->dict:
        "(BatchNorm buffers and their snapshot copies, Batch Renorm layers, parameters), gathered once per fit"
        if self._state is None:
            learn,model = self.learn,self.learn.model
            bufs = [t for m in model.modules() if isinstance(m, BatchNormBase)
                    for t in (m.running_mean, m.running_var, m.num_batches_tracked) if t is not None]
            renorms = [m for m in model.modules() if hasattr(m, 'renorm_steps')]
            params = [p for p,*_ in learn.opt.all_params()] if getattr(learn, 'opt', None) else list(model.parameters())
            self._state = dict(bufs=bufs, buf_copy=[t.clone() for t in bufs], renorms=renorms, params=params, grad_copy=None)
        return self._state

    def snapshot(self)->dict:
        "What a micro-batch can change before its backward ends, kept to undo it (no host synchronisation)"
        st = self._state_tensors()
        window,open_ = self.window_state()
        dev = next(iter(st['params']), torch.empty(0)).device
        snap = dict(rng=torch.get_rng_state(), py=random.getstate(), dev=dev,
                    cuda=torch.cuda.get_rng_state(dev) if dev.type == 'cuda' else None,
                    window=window, renorm=[m.renorm_steps for m in st['renorms']],
                    autocast=autocast_enabled(dev.type) if dev.type in ('cuda', 'cpu') else False, grads=open_)
        if st['bufs']: foreach('copy_')(st['buf_copy'], st['bufs'])
        if open_:   # an open window: its accumulated gradient (else the gradients are zero)
            ps = [p for p in st['params'] if p.grad is not None]
            gc_ = st['grad_copy']
            if gc_ is None or len(gc_[0]) != len(ps) or any(a is not b for a,b in zip(gc_[0], ps)):
                st['grad_copy'] = (ps, [torch.empty_like(p.grad) for p in ps])
            if ps: foreach('copy_')(st['grad_copy'][1], [p.grad for p in ps])
        return snap

    def undo(self, drop:bool=True):
        "Put back everything the micro-batch in progress touched (its snapshot was taken before it began)"
        learn,snap,st = self.learn,self.snap,self._state
        if drop: learn.pred = learn.loss = learn.loss_grad = None   # the attempt's tensors (kept for a cancel's `after_batch`)
        dev = snap['dev']
        if dev.type in ('cuda', 'cpu') and autocast_enabled(dev.type) and not snap['autocast']:
            for cb in learn.cbs:   # MixedPrecision enters autocast in `before_batch` and leaves it in `after_loss`
                if isinstance(cb, MixedPrecision) and getattr(cb, 'autocast', None) is not None: cb.autocast.__exit__(None, None, None)
        for f in list(self.undo_listeners): f()
        gc.collect()
        if dev.type == 'cuda': torch.cuda.empty_cache()
        torch.set_rng_state(snap['rng']); random.setstate(snap['py'])
        if snap['cuda'] is not None: torch.cuda.set_rng_state(snap['cuda'], dev)
        if st['bufs']: foreach('copy_')(st['bufs'], st['buf_copy'])
        for m,v in zip(st['renorms'], snap['renorm']): m.renorm_steps = v
        if snap['grads'] and st['grad_copy'] is not None:
            ps,copy = st['grad_copy']
            foreach('copy_')([p.grad for p in ps], copy)
            kept = set(map(id, ps))
            for p in st['params']:
                if p.grad is not None and id(p) not in kept: p.grad.zero_()
        else:
            for p in st['params']:
                if p.grad is not None: p.grad.zero_()
        self.restore_window(snap['window'])

    def halve(self, msg:str):
        "After an undone out-of-memory micro-batch: half the size, and the same samples cut again"
        size = self.size
        if size <= 1:
            raise RuntimeError(f"GradientAccumulation(micro_bs='auto'): out of memory with a micro-batch of 1 item ({msg}). "
                               "The model does not fit this device at any micro-batch: free memory, use mixed precision, "
                               "a smaller model or smaller inputs") from None
        self.size,self._probe = size//2,None
        self.loader.retry = True
        self._resize_epoch()
        warnings.warn(f"GradientAccumulation: out of memory with micro-batch {size} ({msg}); micro_bs is now {size//2}, "
                      "and the same samples run again", stacklevel=3)

    # -- inference under 'auto' -------------------------------------------------------------------------------------------
    def infer_one_batch(self, one_batch, i, b):
        """Run fastai's `one_batch` on an inference batch with the model's forward, and the loss, each cut into pieces when
        it runs out of memory (a large-vocabulary loss can run out where the forward fitted)"""
        learn,model = self.learn,unwrap(self.learn.model)   # under DDP the wrapped module: DDP's own forward runs once per batch
        own = model.__dict__.get('forward')
        fwd = own if own is not None else model.forward
        model.forward = lambda *args, **kw: self._cut(fwd, args, kw, self._forward_pieces)
        lf = learn.loss_func
        if lf is not None: learn.loss_func = _CutLoss(lf, self)
        try: return one_batch(i, b)
        finally:
            learn.loss_func = lf
            if own is None: model.__dict__.pop('forward', None)
            else: model.forward = own

    def _cut(self, fn, args, kw, pieces):
        "`fn(*args, **kw)` on the whole batch, or in `pieces(fn, args, kw, n, size)` after an out-of-memory error, halving"
        n = find_bs(args)
        while True:
            size = self.inference_bs
            try:
                if size is None or size >= n: return fn(*args, **kw)
                return pieces(fn, args, kw, n, size)
            except BaseException as e:
                if not is_out_of_memory(e): raise
                msg = _first_line(e)
                e.__traceback__ = None
            gc.collect()
            if torch.cuda.is_available(): torch.cuda.empty_cache()
            cur = min(size or n, n)
            if cur <= 1:
                raise RuntimeError(f"GradientAccumulation(micro_bs='auto'): out of memory in inference with a batch of 1 "
                                   f"item ({msg}). The model does not fit this device even for one item") from None
            if is_fsdp(self.learn.model):
                raise RuntimeError(f"GradientAccumulation(micro_bs='auto'): out of memory in inference under FSDP2 ({msg}); "
                                   "its all-gathers cannot be re-run on one rank: make the validation batch smaller "
                                   "(`dls.valid.bs`)") from None
            self.inference_bs = cur//2
            warnings.warn(f"GradientAccumulation: out of memory in inference with a batch of {cur} ({msg}); inference "
                          f"batches are now cut into pieces of {cur//2} (training keeps micro_bs {self.size})", stacklevel=2)

    def _forward_pieces(self, fwd, args, kw, n:int, size:int):
        "The model's outputs of the batch's pieces, joined; a stateful model runs each piece from its own rows"
        rows = self.rows if self.rows else RowStates(stateful_modules(self.learn.model)[0])
        if rows: rows.begin(n)
        try:
            outs = []
            for s,e in piece_bounds(n, size):
                if rows: rows.enter(s, e)
                outs.append(fwd(*slice_batch(args, s, e), **kw))
                if rows: rows.leave(s, e)
            out = cat_outputs(outs)
        except BaseException:
            if rows: rows.n = None
            raise
        if rows: rows.end()
        return out

    @staticmethod
    def _loss_pieces(lf, args, kw, n:int, size:int):
        """The loss of the whole batch from its pieces' losses `lf(pred[s:e], *yb[s:e])`: a sum for a loss that sums, else
        the mean weighted by the count each piece's mean is over (`loss_items`: class weights, `ignore_index`), the
        piece's items otherwise; per-item losses (reduction 'none') joined"""
        outs,ns = [],[]
        for s,e in piece_bounds(n, size):
            pred,*yb = slice_batch(args, s, e)
            outs.append(lf(pred, *yb, **kw))
            c = loss_items(lf, yb)
            ns.append(c if c is not None else torch.tensor(float(e-s)))
        if any(o.ndim for o in outs): return torch.cat(outs)
        loss = torch.stack(outs)
        if loss_reduction(lf) == 'sum': return loss.sum()
        w = torch.stack([torch.as_tensor(c, dtype=torch.float32) for c in ns]).to(loss.device)
        return (torch.where(w > 0, loss.float()*w, 0.).sum()/w.sum()).to(loss.dtype)   # a piece of no item counts nothing

class _CutLoss:
    "The Learner's loss in an inference batch under micro_bs='auto': cut into pieces when it runs out of memory"
    def __init__(self, lf, mb:MicroBatcher): self.lf,self.mb = lf,mb
    def __call__(self, *args, **kw): return self.mb._cut(self.lf, args, kw, self.mb._loss_pieces)
    def __getattr__(self, k): return getattr(self.__dict__['lf'], k)   # `activation`, `decodes`, ... as the loss's own
