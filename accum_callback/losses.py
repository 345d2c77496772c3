"""What a loss averages over. torch's and fastai's class-weighted and `ignore_index` losses are means over the targets'
weight sum or the non-ignored count, not over the batch: `loss_items` gives that count, so that `GradientAccumulation`
weighs each micro-batch by it when the user gives no `n_items`; `loss_reduction` tells a loss that sums (accumulated as
the sum it is). An unknown loss gives None: the batch size rule stands, and `check_accumulation` tells when it is off."""
from __future__ import annotations
import functools
from numbers import Integral
import torch, torch.nn as nn

__all__ = ['check_n_items', 'loss_reduction', 'loss_items', 'micro_items', 'count_dtype', 'SUM_LOSSES']

def _inner(lf):
    """The torch loss module behind fastai's `BaseLoss` wrappers (`CrossEntropyLossFlat`, ..., and a subclass that keeps
    `BaseLoss.__call__`, such as one that only sets arguments in its `__init__`), or `lf` itself"""
    f = getattr(lf, 'func', None)
    if not isinstance(f, nn.Module): return lf
    base = _fastai_base_loss()
    if base is not None and isinstance(lf, base): return f if type(lf).__call__ is base.__call__ else lf
    return f if type(lf).__module__.startswith('fastai.') else lf

@functools.lru_cache(maxsize=None)
def _fastai_base_loss():
    try: from fastai.losses import BaseLoss
    except ImportError: return None
    return BaseLoss

# torch and fastai losses whose `reduction='sum'` is a plain sum over items (so accumulating micro-batch sums is exact)
_CE = (nn.CrossEntropyLoss, nn.NLLLoss)
SUM_LOSSES = _CE + (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
                    nn.SoftMarginLoss, nn.MultiLabelSoftMarginLoss, nn.PoissonNLLLoss, nn.GaussianNLLLoss)

@functools.lru_cache(maxsize=None)
def _fastai_sum_losses():
    try: from fastai.losses import FocalLoss, LabelSmoothingCrossEntropy
    except ImportError: return ()
    return (FocalLoss, LabelSmoothingCrossEntropy)

def loss_reduction(loss_func)->str|None:
    "'sum' for a loss class known to sum over its items with `reduction='sum'`, 'mean' for one known to average, else None"
    f = _inner(loss_func)
    if not isinstance(f, SUM_LOSSES + _fastai_sum_losses()): return None
    r = getattr(f, 'reduction', None)
    return r if r in ('sum', 'mean') else None

def loss_items(loss_func, yb)->torch.Tensor|None:
    """How many items a micro-batch's mean loss averages over, for the losses whose mean is not over the batch: torch's
    `CrossEntropyLoss`/`NLLLoss` (and fastai's `CrossEntropyLossFlat`) with class indices as targets, a `weight` or
    targets equal to `ignore_index` (the count of non-ignored targets, weighted). A 0-d tensor on the targets' device
    (no host synchronisation, a plain tensor whatever fastai type the targets have); None where the batch size is the
    right count (or the loss is unknown)."""
    f = _inner(loss_func)
    if not isinstance(f, _CE) or getattr(f, 'reduction', 'mean') != 'mean' or len(yb) != 1: return None
    t = yb[0]
    if not isinstance(t, torch.Tensor) or t.is_floating_point(): return None   # probability targets: a mean over items
    t = t.as_subclass(torch.Tensor)   # fastai's typed targets (TensorCategory) refuse arithmetic with other types
    keep = t != f.ignore_index
    w = getattr(f, 'weight', None)
    if w is None: return keep.sum().float()
    w = w.to(t.device)
    return (w[torch.where(keep, t, 0).long()] * keep).sum().to(torch.float64 if w.dtype == torch.float64 else torch.float32)

def check_n_items(n_items):
    "`GradientAccumulation(n_items=...)`, checked: a function `f(learn) -> int` or None"
    if n_items is not None and not callable(n_items):
        raise TypeError(f"`n_items` must be a function `f(learn) -> int` or None, got {type(n_items).__name__}")
    return n_items

def micro_items(learn, n_items=None, default=None):
    """The count a micro-batch's loss averages over, the one rule of training and of the check: `n_items(learn)` (the
    user's), else that of a known weighted / `ignore_index` loss (`loss_items`), else `default` (the batch size). A number
    or a 0-d float tensor (not synchronised: the window sums them on the device), in float64 where the loss is (so that
    a float64 model's weights and counts are not rounded to float32), else in float32"""
    n = n_items(learn) if n_items is not None else loss_items(learn.loss_func, learn.yb)
    if n is None: n = default
    if isinstance(n, torch.Tensor): return n.detach().to(count_dtype(getattr(learn, 'loss_grad', None))).squeeze()
    if isinstance(n, bool) or not isinstance(n, (Integral, float)):
        raise TypeError(f"`n_items` must return an int or a 0-d tensor, got {type(n).__name__}")
    return n

def count_dtype(loss)->torch.dtype:
    "The precision item counts and the window's loss sum are kept in: float64 for a float64 loss, else float32"
    return torch.float64 if getattr(loss, 'dtype', None) == torch.float64 else torch.float32
