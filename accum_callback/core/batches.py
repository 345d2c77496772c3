"""A batch as the Learner's training step sees it, for everything that runs batches outside fastai's loop (the check,
the noise scale, the replay, the recomputed BatchNorm statistics): moved to the model's device (fastai's `_set_device`),
split into inputs and targets (`_split`), then through the callbacks' `before_batch` (fastai's `CastToTensor`, which
casts `TensorImage`/`TensorCategory` to plain tensors for a torch loss; `ModelToHalf`; a `before_batch_cb`; a user's
own), with whatever those callbacks set on the Learner and on themselves put back after."""
from __future__ import annotations
import contextlib

from fastai.callback.core import GatherPredsCallback
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.hook import HookCallback
from fastai.callback.mixup import MixHandler
from fastai.callback.schedule import ParamScheduler
from fastai.torch_core import to_device

from .loaders import model_device

__all__ = ['prepare_batch', 'split_batch', 'batch_shapers', 'step_kept']

# fastai's callbacks whose `before_batch` is not about the batch, or is only right inside a fit: autocast (the replay
# runs its own), the optimizer's hyper-parameters, hooks that `after_batch` removes, the predictions' gatherer, and
# MixUp/CutMix (their loss is swapped in by `before_train`, so a mixed batch outside a fit would meet the unmixed loss)
_NOT_SHAPING = (MixedPrecision, ParamScheduler, HookCallback, GatherPredsCallback, MixHandler)

_STEP_KEYS = ('xb', 'yb', 'pred', 'loss', 'loss_grad', 'training')

@contextlib.contextmanager
def step_kept(learn, cbs:list):
    "Whatever running `cbs`' events sets on the Learner (its step's attributes) and on the callbacks is put back after"
    saved = {k: learn.__dict__[k] for k in _STEP_KEYS if k in learn.__dict__}
    states = [(cb, dict(cb.__dict__)) for cb in cbs]
    try: yield
    finally:
        for k in _STEP_KEYS: learn.__dict__.pop(k, None)
        learn.__dict__.update(saved)
        for cb,d in states: cb.__dict__.clear(); cb.__dict__.update(d)

def _has_before_batch(cb)->bool:
    "Its class's, or its own (`Callback(before_batch=f)`, as fastai's `before_batch_cb` makes it)"
    return callable(getattr(type(cb), 'before_batch', None)) or callable(cb.__dict__.get('before_batch'))

def batch_shapers(learn)->list:
    """The Learner's callbacks whose `before_batch` shapes the batch training runs, in their order: not ours (they keep
    the fit's bookkeeping), nor fastai's listed in `_NOT_SHAPING`"""
    return [cb for cb in learn.cbs.sorted('order')
            if _has_before_batch(cb) and not isinstance(cb, _NOT_SHAPING)
            and not type(cb).__module__.startswith('accum_callback')]

def split_batch(learn, b)->tuple[tuple,tuple]:
    "`(xb, yb)` of a batch, split as fastai's `Learner._split` splits it (the loaders' `n_inp`)"
    i = getattr(learn.dls, 'n_inp', 1 if len(b) == 1 else len(b)-1)
    return tuple(b[:i]),tuple(b[i:])

def prepare_batch(learn, b)->tuple[tuple,tuple]:
    """`(xb, yb)` of the loader batch (or piece of one) `b` as the Learner's training step sees them: on the model's
    device, split, and through the callbacks' `before_batch` (`batch_shapers`) in training mode; the Learner's step
    attributes and those callbacks' own attributes are put back after"""
    xb,yb = split_batch(learn, to_device(b, model_device(learn.model)))
    cbs = batch_shapers(learn)
    if not cbs: return xb,yb
    with step_kept(learn, cbs):
        learn.xb,learn.yb,learn.training = xb,yb,True
        for cb in cbs:
            try: cb('before_batch')
            except Exception as e:
                raise RuntimeError(f"preparing a batch as training does, outside the training loop: "
                                   f"`{type(cb).__name__}.before_batch` raised {type(e).__name__}: {e}; run this with "
                                   f"that callback removed (`with learn.removed_cbs(cb): ...`)") from e
        return tuple(learn.xb),tuple(learn.yb)
