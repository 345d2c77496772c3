"""What a loss averages over. torch's and fastai's class-weighted and `ignore_index` losses are means over the targets'
weight sum or the non-ignored count, not over the batch: `loss_items` gives that count, so that `GradientAccumulation`
weighs each micro-batch by it when the user gives no `n_items`; a Hugging Face model's own loss (the output's `loss`,
from `labels` that hold -100) is counted the same way (`own_loss_items`); `loss_reduction` tells a loss that sums
(accumulated as the sum it is). An unknown loss gives None: the batch size rule stands, and `check_accumulation` tells
when it is off."""
from __future__ import annotations
import functools, weakref
from collections.abc import Mapping
from numbers import Integral
import torch, torch.nn as nn, torch.nn.functional as F

__all__ = ['check_n_items', 'loss_reduction', 'loss_items', 'micro_items', 'count_dtype', 'SUM_LOSSES', 'model_loss',
           'own_loss_items', 'counting_note', 'IGNORE_INDEX']

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
    """'sum' for a loss class known to sum over its items with `reduction='sum'`, 'mean' for one known to average, else
    None"""
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
    return (w[torch.where(keep, t, 0).long()] * keep).sum().to(torch.float64 if w.dtype == torch.float64
                                                               else torch.float32)

def check_n_items(n_items):
    "`GradientAccumulation(n_items=...)`, checked: a function `f(learn) -> int` or None"
    if n_items is not None and not callable(n_items):
        raise TypeError(f"`n_items` must be a function `f(learn) -> int` or None, got {type(n_items).__name__}")
    return n_items

# -- a model's own loss (Hugging Face: the output's `loss`, computed from `labels`)
# ----------------------------------------
IGNORE_INDEX = -100   # torch's and Hugging Face's label for a position the loss leaves out (padding, the prompt)

def _field(o, k):
    """`o[k]` of a mapping output, else the attribute (a `ModelOutput` is both; a dataclass or a namedtuple the
    attribute)"""
    return o.get(k) if isinstance(o, Mapping) else getattr(o, k, None)

def model_loss(pred):
    "The loss a model output carries: a Hugging Face `ModelOutput`'s (or a dict's) `loss`, a 0-d tensor; else None"
    l = _field(pred, 'loss')
    return l if isinstance(l, torch.Tensor) and l.ndim == 0 else None

def _is_own(pred, loss)->bool:
    "Is `loss` the model's own (the loss function returned the output's `loss`, as `lambda out, *y: out.loss` does)?"
    l = model_loss(pred)
    if l is None or not isinstance(loss, torch.Tensor): return False
    return loss is l or (loss.ndim == 0 and loss.data_ptr() == l.data_ptr())

def _labels(xb):
    "The `labels` the model was given: a dict input's (Hugging Face's, blurr's batches), or None"
    return next((x['labels'] for x in xb if isinstance(x, Mapping) and isinstance(x.get('labels'), torch.Tensor)), None)

# what each model's own loss averages over, found once per model: 'tokens' (labels not IGNORE_INDEX), 'shifted' (the
# same,
# but for the first position of each row: a causal LM predicts token t+1 at t), 'rows' (float labels: a mean over rows),
# None (neither matches: unknown, the batch size rule stands and the fit start says so). Not kept while undecided.
_RULES = weakref.WeakKeyDictionary()

MATCH = 1e-3    # relative: a candidate within it may be the model's loss (the model may compute in another precision)
CLEARLY = 10.   # a candidate is chosen where the other misses the model's loss by this many times more

def _hf_names(mapping:str)->frozenset:
    "The class names of one of transformers' auto mappings (empty where transformers is not imported: no import here)"
    import sys
    if 'transformers' not in sys.modules: return frozenset()
    try:
        from transformers.models.auto import modeling_auto
        return frozenset(getattr(modeling_auto, mapping, {}).values())
    except ImportError: return frozenset()

def declared_rule(model)->str|None:
    """What a model's own loss averages over where its class says: a Hugging Face causal LM (a class of transformers'
    `MODEL_FOR_CAUSAL_LM_MAPPING`) shifts its labels ('shifted'), a sequence-to-sequence LM does not ('tokens'). The
    model or the one Hugging Face model it wraps; None where it does not say (or wraps several)"""
    if not isinstance(model, nn.Module): return None
    causal = _hf_names('MODEL_FOR_CAUSAL_LM_MAPPING_NAMES')
    seq2seq = _hf_names('MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES')
    if not causal and not seq2seq: return None
    try: from transformers import PreTrainedModel
    except ImportError: return None
    hf = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    outer = [m for m in hf if not any(m is not o and any(m is c for c in o.modules()) for o in hf)]
    if len(outer) != 1: return None
    name = type(outer[0]).__name__
    return 'shifted' if name in causal else 'tokens' if name in seq2seq else None

@torch.no_grad()
def _own_rule(pred, labels, loss, declared=None)->tuple[str|None, bool]:
    """Which count `loss` (a model's own) averages over, and whether that is decided: the cross-entropy of the output's
    `logits` against `labels` as they stand ('tokens') and shifted one position ('shifted'), in float64, compared with
    the loss the model gave. The `declared` rule (`declared_rule`) where it matches within `MATCH`; else the candidate
    that matches where the other misses `CLEARLY` more (beyond the loss dtype's rounding); else, where both match,
    the closer one for this micro-batch only (undecided: asked again at the next). 'rows' for float labels (regression,
    multi-label: a mean over a fixed number of values a row); None, decided, where no candidate matches"""
    if labels.is_floating_point(): return 'rows',True
    logits = _field(pred, 'logits')
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point(): return None,True
    lg,lb,cands = logits.detach().double(),labels.long(),{}
    if lg.ndim == lb.ndim+1 and lg.shape[:-1] == lb.shape:
        cands['tokens'] = lambda: F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lb.reshape(-1),
                                                  ignore_index=IGNORE_INDEX)
        if lb.ndim >= 2:
            cands['shifted'] = lambda: F.cross_entropy(lg[..., :-1, :].reshape(-1, lg.shape[-1]),
                                                       lb[..., 1:].reshape(-1),
                                                       ignore_index=IGNORE_INDEX)
    v = float(loss.detach().double())
    scale = max(abs(v), 1e-6)
    miss = {k: abs(float(f())-v) for k,f in cands.items()}
    miss = {k: e for k,e in miss.items() if e == e}   # (a candidate with no target left: nan, out of the running)
    near = sorted((e,k) for k,e in miss.items() if e <= MATCH*scale)
    if not near: return None,True
    if declared in miss and miss[declared] <= MATCH*scale: return declared,True
    (e,k),rest = near[0],[x for j,x in miss.items() if j != near[0][1]]
    rounding = 64*torch.finfo(loss.dtype).eps*scale if loss.is_floating_point() else 0.
    return k,all(x > CLEARLY*max(e, rounding) for x in rest)

def own_loss_items(learn)->torch.Tensor|None:
    """The count a model's own loss averages over (see `_own_rule`), for the micro-batch `learn` holds: the labels not
    `IGNORE_INDEX`, shifted as a causal LM shifts them. None where the loss is not the model's own, or is a mean over
    rows (the batch size is right), or its count cannot be told (said once at fit start: `counting_note`)"""
    pred,loss = getattr(learn, 'pred', None),getattr(learn, 'loss_grad', None)
    if not _is_own(pred, loss): return None
    labels = _labels(getattr(learn, 'xb', ()))
    if labels is None: return None
    model = getattr(learn, 'model', None)
    if model is not None and model in _RULES: rule = _RULES[model]
    else:
        if not torch.isfinite(loss.detach()): return None   # (a non-finite loss tells nothing: decided at the next)
        rule,decided = _own_rule(pred, labels, loss, declared_rule(model))
        if decided and model is not None: _RULES[model] = rule   # (a Learner without a model: decided each time)
    if rule not in ('tokens', 'shifted'): return None
    return ((labels[..., 1:] if rule == 'shifted' else labels) != IGNORE_INDEX).sum()

def counting_note(learn, n_items=None)->str|None:
    """What to say once, at a fit's first micro-batch, where the library cannot know what the loss averages over and a
    count other than the batch size is likely: a model's own loss it cannot match, or an unknown loss with targets that
    hold `IGNORE_INDEX`. None where it knows (or `n_items` is given)"""
    if n_items is not None or loss_items(learn.loss_func, learn.yb) is not None: return None
    pred,loss = getattr(learn, 'pred', None),getattr(learn, 'loss_grad', None)
    if _is_own(pred, loss):
        labels = _labels(learn.xb)
        if labels is not None and _RULES.get(learn.model, 'rows') is not None: return None
        what = ("the model computes its own loss (the output's `loss`) and its count could not be told from its "
                "`labels` and `logits`" if labels is not None else
                "the model computes its own loss (the output's `loss`) from labels not given in a dict input's "
                "`labels`")
    else:
        if not any(isinstance(t, torch.Tensor) and not t.is_floating_point() and bool((t == IGNORE_INDEX).any())
                   for t in learn.yb):
            return None
        what = (f"the loss is not one this library knows, and the targets hold {IGNORE_INDEX} (positions a loss leaves "
                "out)")
    return (f"{what}: each micro-batch is weighed by its rows, which is the large batch's gradient only if the loss is "
            "a mean over rows. If it averages over tokens, pass GradientAccumulation(n_items=lambda learn: <the count "
            "of learn.yb the loss averages over>); learn.check_accumulation() names the cause ('n_items')")

def micro_items(learn, n_items=None, default=None):
    """The count a micro-batch's loss averages over, the one rule of training and of the check: `n_items(learn)` (the
    user's), else that of a known weighted / `ignore_index` loss (`loss_items`), else `default` (the batch size). A
    number or a 0-d float tensor (not synchronised: the window sums them on the device), in float64 where the loss is
    (so that a float64 model's weights and counts are not rounded to float32), else in float32"""
    n = n_items(learn) if n_items is not None else loss_items(learn.loss_func, learn.yb)
    if n is None and n_items is None: n = own_loss_items(learn)
    if n is None: n = default
    if isinstance(n, torch.Tensor): return n.detach().to(count_dtype(getattr(learn, 'loss_grad', None))).squeeze()
    if isinstance(n, bool) or not isinstance(n, (Integral, float)):
        raise TypeError(f"`n_items` must return an int or a 0-d tensor, got {type(n).__name__}")
    return n

def count_dtype(loss)->torch.dtype:
    "The precision item counts and the window's loss sum are kept in: float64 for a float64 loss, else float32"
    return torch.float64 if getattr(loss, 'dtype', None) == torch.float64 else torch.float32
