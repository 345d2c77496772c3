"""Models that carry state from one batch to the next (fastai's AWD_LSTM/AWD_QRNN, modules with `get_batch_state`/
`set_batch_state`): which modules do (`stateful_modules`), the per-row state of a batch cut into pieces (`RowStates`),
and copying a model that keeps tensors computed in its forward (`copy_module`)."""
from __future__ import annotations
import copy, functools, inspect

import torch, torch.nn as nn

from ..compat.torch import tree_flatten, tree_unflatten
from ..core.distributed import unwrap

__all__ = ['copy_module', 'StatefulModelError', 'stateful_modules', 'refuse_stateful', 'RowStates']

def _computed_tensors(model:nn.Module, depth:int=3):
    """Tensors computed in a forward (not graph leaves) that the modules keep as attributes, inside lists, tuples and
    dicts too, or that objects they hold keep (fastai's `Hook.stored`, in a U-Net's blocks), up to `depth` objects
    away"""
    seen,level = set(),[vars(m) for m in model.modules()]
    for _ in range(depth):
        nxt = []
        for d in level:
            for t in tree_flatten(d)[0]:
                if isinstance(t, torch.Tensor):
                    if not t.is_leaf: yield t
                elif (not isinstance(t, (nn.Module, type)) and isinstance(getattr(t, '__dict__', None), dict)
                      and id(t) not in seen):
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
        raise TypeError("a batch state must be a tensor or tuples/lists of tensors, got "
                        + ', '.join(sorted({type(t).__name__ for t in leaves})))
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

def _resets_batch_state(m)->bool:
    """Does `m` have fastai's sign of batch state, a `reset()` that `ModelResetter` can call with no argument? A `reset`
    that takes required arguments is something else (timm's classifier heads: `reset(num_classes)` rebuilds the
    layer)"""
    f = getattr(m, 'reset', None)
    if not callable(f): return False
    try: inspect.signature(f).bind()
    except TypeError: return False   # (it needs arguments)
    except ValueError: return True   # (no signature to read: a builtin, taken at its word)
    return True

def _declares_state(m)->bool:
    """Does `m` declare state it carries between batches, which it cannot split per row: `carries_batch_state = True`,
    or a `reset()` callable without arguments (unless fastai's own modules known to hold nothing)"""
    if getattr(m, 'carries_batch_state', None) is True: return True
    return _resets_batch_state(m) and not _known_stateless(m)

def stateful_modules(model:nn.Module)->tuple[list, list]:
    """`(splittable, unsplittable)`: the modules of `model` that carry state from one batch to the next. Splittable:
    fastai's `AWD_LSTM`/`AWD_QRNN`, and any module with `get_batch_state(bs)` and `set_batch_state(state)`.
    Unsplittable: any other module that declares state (`carries_batch_state = True`, or a `reset()` callable without
    arguments: fastai's sign of a model with state, which `ModelResetter` calls; a `reset` that needs arguments is not
    it). Not counted: what sits inside a module that holds no state (`carries_batch_state = False`, or fastai's
    `SentenceEncoder`, which resets its AWD_LSTM at every forward), and modules inside a splittable one (its own
    business)."""
    model = unwrap(model)
    ok,bad,skip = [],[],set()
    for m in model.modules():
        if id(m) in skip: continue
        if _holds_no_state(m): skip.update(id(c) for c in m.modules()); continue
        if callable(getattr(m, 'get_batch_state', None)) and callable(getattr(m, 'set_batch_state', None)):
            a = _ProtocolState(m)
        elif type(m).__name__ in ('AWD_LSTM', 'AWD_QRNN') and hasattr(m, 'hidden') and hasattr(m, '_change_hidden'):
            a = _AWDState
        elif _declares_state(m): bad.append(m); continue
        else: continue
        ok.append((m, a))
        skip.update(id(c) for c in m.modules())
    return ok,bad

def refuse_stateful(bad:list, model:nn.Module):
    names = ', '.join(sorted({type(m).__name__ for m in bad}))
    raise StatefulModelError(
        f"MicroBatching(size): the model carries state from one batch to the next ({names} declares it: a `reset()` "
        "without arguments, or `carries_batch_state = True`), and each micro-batch would start from another "
        "micro-batch's rows. Give the module `get_batch_state(bs)` and `set_batch_state(state)` (see "
        "docs/micro_batching.md: rows along `batch_state_dim`), set `carries_batch_state = False` on it if it holds no "
        "state between batches, or feed the loader micro-batches and accumulate with `n_step` instead of "
        "`MicroBatching`")

class RowStates:
    """The per-row state of a batch cut into pieces: each piece starts from its own rows of the state the whole batch
    would start from, and what it leaves is written back into those rows; after the last piece the module holds the
    state of the whole batch, as if it had not been cut. A piece run again (out-of-memory retry) starts from the same
    rows.

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
                # e.g. zeros of the default dtype
                if out[i].dtype != t.dtype or out[i].device != t.device: out[i] = out[i].to(t)
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
            # reset inside a piece: it runs from its rows of it
            if self.piece is not None: self._set_rows(i, *self.piece)
        return res
    def watch(self):
        "Wrap each module's `reset` (an instance attribute, removed by `unwatch`)"
        for i,(m,_) in enumerate(self.mods):
            orig = getattr(m, 'reset', None)
            if callable(orig) and 'reset' not in m.__dict__:
                m.__dict__['reset'] = functools.partial(self._reset, i, orig)
    def unwatch(self):
        for m,_ in self.mods:
            f = m.__dict__.get('reset')
            if isinstance(f, functools.partial) and getattr(f.func, '__self__', None) is self: del m.__dict__['reset']

