"""Every fastai name outside fastai's public API that the library uses, in one place (as `compat/torch.py` holds
torch's), each found by what this fastai has, with a clear refusal naming the fastai version where it is gone.
`tests/test_package.py` fails when another module reaches for one of these names itself.

- `Learner._with_events(f, event_type, ex, final)`: fastai runs each event pair through it and looks it up for every
  epoch after `before_fit`; the fit's clean-up guard (`protocols.FitGuard`) wraps it on the instance for one fit.
- `Recorder._train_mets`: the running training metrics (smooth loss, ...) a checkpoint saves mid-epoch.
- `DataLoader.fake_l` (a `fastai.data.load._FakeLoader`): the torch loader behind a fastai loader, whose `generator`
  seeds its iterator (a resumed pass draws that seed from a generator of its own), and which a copied loader needs its
  own of (`copy_loader`)."""
from __future__ import annotations
from fastai.learner import Learner

__all__ = ['epoch_events', 'set_epoch_events', 'clear_epoch_events', 'train_metrics', 'torch_loader', 'copy_loader']

_EVENTS = '_with_events'
if not callable(getattr(Learner, _EVENTS, None)):
    import fastai
    raise ImportError("accum_callback needs fastai's Learner._with_events (every event pair of a fit runs through "
                      f"it), which fastai {fastai.__version__} does not have: please report it")

def epoch_events(learn, own:bool=False):
    "`learn._with_events`: the one fastai calls now, or (`own`) only one set on this instance (None where none is)"
    return learn.__dict__.get(_EVENTS) if own else getattr(learn, _EVENTS)

def set_epoch_events(learn, f):
    "Put `f(f, event_type, ex, final)` in place of `learn._with_events` on this instance"
    learn.__dict__[_EVENTS] = f

def clear_epoch_events(learn):
    "Take an instance's own `_with_events` off: fastai's method again"
    learn.__dict__.pop(_EVENTS, None)

def train_metrics(recorder)->list:
    "The Recorder's running training metrics (its smooth loss first), or none where this fastai keeps them otherwise"
    return list(getattr(recorder, '_train_mets', []))

def torch_loader(dl):
    "The torch `DataLoader` behind a fastai loader (`fake_l`), or None"
    return getattr(dl, 'fake_l', None)

def copy_loader(dl):
    """A shallow copy of a fastai loader that iterates on its own: a copy shares the original's torch loader (`fake_l`),
    which draws the order from the original (`DistributedDL`, which `new` cannot make, is copied)"""
    import copy
    from fastai.data.load import _FakeLoader
    new = copy.copy(dl)
    if isinstance(fl := torch_loader(dl), _FakeLoader):   # (as fastai's loaders make theirs)
        kw = dict(persistent_workers=fl.persistent_workers)
        # (not in every fastai this package supports)
        if hasattr(fl, 'pin_memory_device'): kw['pin_memory_device'] = fl.pin_memory_device
        new.fake_l = _FakeLoader(new, fl.pin_memory, fl.num_workers, fl.timeout, **kw)
    return new
