"""Cutting a batch: which rows each piece holds (one rule, `piece_bounds`, and the halving after an out-of-memory error,
`halved`), slicing a batch and joining the pieces' outputs, and telling an out-of-memory error from others."""
from __future__ import annotations
import dataclasses
from collections.abc import Mapping

import torch

from ..compat.torch import OutOfMemoryError

__all__ = ['is_out_of_memory', 'n_pieces', 'next_piece', 'piece_bounds', 'halved', 'slice_batch', 'cat_outputs',
           'first_line', 'batch_size', 'batch_tensors', 'mapping_like']

_OOM_TEXTS = ('out of memory', 'CUBLAS_STATUS_ALLOC_FAILED', 'CUDNN_STATUS_ALLOC_FAILED', 'CUDNN_STATUS_NOT_SUPPORTED',
              'canUse32BitIndexMath')   # cuDNN/cuBLAS's ways of saying a batch is too large for the device

def is_out_of_memory(e:BaseException)->bool:
    "Does `e` say the micro-batch did not fit: `torch.OutOfMemoryError`, or a RuntimeError that means the same"
    if isinstance(e, OutOfMemoryError): return True
    return isinstance(e, RuntimeError) and any(t in str(e) for t in _OOM_TEXTS)

def n_pieces(n:int, size:int)->int:
    """How many pieces `MicroBatching(size)` cuts `n` items into: `ceil(n/size)` (the rule; `piece_bounds` gives their
    rows)"""
    return -(-n//max(1, size))

def next_piece(s:int, n:int, size:int, nom=None)->tuple:
    """The end of the piece that starts at item `s` of `n`, and the `nom` for the next piece: the items left are cut
    into `ceil(left/size)` near-equal pieces, counted on `nom` instead of the items left where given (under DDP: the
    loader's batch size less `size` per piece cut, so that a rank's short batch is cut into as many pieces as the
    others')"""
    left = n-s
    e = s + -(-left//n_pieces(left if nom is None else nom, size))
    return e,(None if nom is None else max(nom-size, 1))

def piece_bounds(n:int, size:int)->list:
    """`(start, end)` of the near-equal pieces `MicroBatching(size)` cuts `n` items into: `ceil(n/size)` pieces, none
    larger than `size` (None: one, uncut)"""
    if not size: return [(0, n)]
    out,s = [],0
    while s < n: e,_ = next_piece(s, n, size); out.append((s, e)); s = e
    return out

def halved(size:int)->int:
    "The micro-batch size after an out-of-memory error at `size` (training, inference and the check's simulation alike)"
    return size//2

def first_line(e:BaseException)->str: return str(e).splitlines()[0][:200] if str(e) else type(e).__name__

def slice_batch(b, s:int, e:int):
    """Items `s:e` of a batch: tensors sliced along their first dimension, tuples and lists element by element, dicts
    (Hugging Face's `BatchEncoding`, blurr's batches: `input_ids`, `attention_mask`, `labels`) key by key"""
    if isinstance(b, torch.Tensor): return b[s:e]
    if isinstance(b, (tuple, list)): return type(b)(slice_batch(o, s, e) for o in b)
    if isinstance(b, Mapping): return _mapping_like(b, {k: slice_batch(v, s, e) for k,v in b.items()})
    if b is None: return None
    raise TypeError(f"MicroBatching(size) cannot split a batch element of type {type(b).__name__}: "
                    "only tensors and tuples, lists and dicts of them (give the loader micro-batches instead, with "
                    "`n_step`)")

def _mapping_like(o:Mapping, d:dict):
    """`d` as a mapping of `o`'s type (a `BatchEncoding`, a `ModelOutput`), or as the dict it is where that type cannot
    be made from one"""
    try: return type(o)(d)
    except TypeError: return d
mapping_like = _mapping_like   # (public: the inference cutter rebuilds an output's type with it)

def batch_tensors(o)->list:
    """The tensors of a batch or a model output that have a batch dimension, in order: a tensor; the elements of tuples
    and lists; the values of dicts (a Hugging Face `ModelOutput`), the fields of dataclasses. A 0-d tensor (a loss the
    model computed over its whole batch) and anything else (a key-value cache object) are left out: no row of them is
    one sample's"""
    if isinstance(o, torch.Tensor): return [o] if o.ndim else []
    if isinstance(o, (tuple, list)): return [t for x in o for t in batch_tensors(x)]
    if isinstance(o, Mapping): return batch_tensors(list(o.values()))
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return batch_tensors([getattr(o, f.name) for f in dataclasses.fields(o)])
    return []

def batch_size(b)->int|None:
    """The rows of a batch or a model output: the first dimension of its first tensor that has one (`batch_tensors`; a
    Hugging Face `ModelOutput` starts with its 0-d `loss`, where fastai's `find_bs` fails)"""
    return next((t.shape[0] for t in batch_tensors(b)), None)

def cat_outputs(outs:list):
    """The model outputs of consecutive pieces of a batch joined along the first dimension (tensors, tuples, lists,
    dicts)"""
    o = outs[0]
    if isinstance(o, torch.Tensor):
        if o.ndim == 0:
            raise TypeError("the model returns a 0-d tensor: its output cannot be joined over micro-batches")
        return torch.cat(outs)
    if isinstance(o, (tuple, list)): return type(o)(cat_outputs(list(z)) for z in zip(*outs))
    if isinstance(o, Mapping): return _mapping_like(o, {k: cat_outputs([x[k] for x in outs]) for k in o})
    if o is None: return None
    raise TypeError(f"the model returns a {type(o).__name__}: only tensors, tuples, lists and dicts of them can be "
                    "joined over micro-batches")

