"Fit bookkeeping shared by the callbacks: clean-up when an exception leaves `fit`, and telling a fit from inference"
from __future__ import annotations
from fastai.callback.core import CancelEpochException, CancelFitException

__all__ = ['FitGuard', 'add_fit_guard', 'remove_fit_guard', 'in_inference']

CANCELS = (CancelEpochException, CancelFitException)  # after these, fit still goes on to `after_fit`

def in_inference(learn)->bool:
    """Is `learn` inside `validate`/`get_preds`/`predict`/`tta` rather than a training `fit`? fastai sends `before_fit`
    and `after_fit` there too, holding `learn.lock`: a callback must neither set up nor raise then (a raise inside
    `validation_context` leaves the lock held, and every later `validate` on that Learner blocks forever)."""
    lock = getattr(learn, 'lock', None)
    return lock is not None and lock.locked()

class FitGuard:
    """Wraps `learn._do_epoch` for the length of a `fit` (fastai looks it up once per epoch, after `before_fit`):
    every exception leaving an epoch calls each registered `cleanup(exc)`; one that ends the fit without `after_fit`
    also removes the guard, so the Learner is left as it was (and still pickles)."""
    def __init__(self, learn):
        self.learn,self.orig,self.cleanups = learn,learn._do_epoch,{}
    def __call__(self):
        try: return self.orig()
        except BaseException as e:
            for f in list(self.cleanups.values()): f(e)
            if not isinstance(e, CANCELS): self.learn.__dict__.pop('_do_epoch', None)
            raise

def add_fit_guard(learn, key, cleanup):
    "Call `cleanup(exc)` when an exception leaves an epoch of this `fit`; `key` names it for `remove_fit_guard`"
    g = learn.__dict__.get('_do_epoch')
    if not isinstance(g, FitGuard): g = learn._do_epoch = FitGuard(learn)
    g.cleanups[key] = cleanup

def remove_fit_guard(learn, key):
    "Forget `key`'s clean-up; the guard goes once it has none"
    g = learn.__dict__.get('_do_epoch')
    if not isinstance(g, FitGuard): return
    g.cleanups.pop(key, None)
    if not g.cleanups: del learn.__dict__['_do_epoch']
