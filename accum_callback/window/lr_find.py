"""fastai's `lr_find` with accumulation: a rate per optimizer step, not per micro-batch. fastai's `LRFinder` moves the
rate at every batch and reads each batch's smoothed loss; under `GradientAccumulation` a rate is then held for a whole
window and single micro-batches' losses (noisy) stop it early. `WindowedLRFinder`, joined for a fit that has an
`LRFinder` (by its public class), drives that finder through its protocols: its schedules (`scheds`) read the steps
taken over `num_it`, the Recorder keeps one rate and one loss a window (the window's item-weighted mean, smoothed as the
Recorder smooths), the early stop and `num_it` count steps, and the fit has the epochs `num_it` steps need."""
from __future__ import annotations
import math

import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import LRFinder

__all__ = ['WindowedLRFinder', 'lr_finder']

def lr_finder(learn)->LRFinder|None:
    "The `LRFinder` among `learn`'s callbacks (`lr_find`'s), or None"
    return next((c for c in learn.cbs if isinstance(c, LRFinder)), None)

class WindowedLRFinder(Callback):
    "`lr_find` under a window owner `ga`: a rate a step, a recorded loss a window (see the module)"
    order = 55   # after the Recorder's `after_batch` (50), before the LRFinder's and the progress bar's (60)
    run_valid = False
    def __init__(self, ga, finder:LRFinder): self.ga,self.finder = ga,finder

    def before_fit(self):
        f,learn = self.finder,self.learn
        self.num_it,self.steps,self.skipped = f.num_it,0,self.ga.n_skipped
        self.val,self.count,self.value = 0.,0,None
        self.closed = None   # the loss of the window closing in this micro-batch, or None
        self.scheds = sched = f.scheds
        f.scheds = {k: (lambda pct, s=s: s(min(self.steps/self.num_it, 1.))) for k,s in sched.items()}
        f.num_it = math.inf   # (the steps are counted here: the finder's own count is of micro-batches)
        units = self.ga.plan.units(0, learn.dls.train.bs)
        per_epoch = max(1, len(learn.dls.train)//max(1, units))
        learn.n_epoch = self.num_it//per_epoch + 1   # fastai's rule, in steps
        self._listen = self.ga.on_window_close(self._window_closed)

    def _window_closed(self, stepped:bool):
        l = self.ga.window_losses[-1] if stepped else None
        if stepped:
            loss = l.detach().cpu() if isinstance(l, torch.Tensor) else torch.tensor(float(l), dtype=torch.float64)
        elif self.ga.n_skipped > self.skipped: loss = torch.tensor(math.inf)   # (a non-finite window: diverged)
        else: return   # (a partial window dropped at an epoch's end: no step)
        self.skipped = self.ga.n_skipped
        self.closed = loss

    def after_batch(self):
        rec = self.learn.recorder
        if not rec.lrs: return
        lr,_ = rec.lrs.pop(),rec.losses.pop()   # (the Recorder's entry of this micro-batch; its rate is its window's)
        if self.closed is not None:
            loss,self.closed = self.closed,None
            beta = rec.smooth_loss.beta   # smoothed as the Recorder smooths a plain fit's batches
            self.count += 1
            self.val = beta*self.val + (1-beta)*loss
            self.value = self.val/(1-beta**self.count)   # (in the loss's dtype: float64 kept)
            rec.lrs.append(lr); rec.losses.append(self.value)
            self.steps += 1
        # what the LRFinder's early stop and the bar read: the windows' smoothed loss (none yet: nothing to stop on)
        self.learn.smooth_loss = self.value if self.value is not None else torch.tensor(math.inf)
        if self.steps >= self.num_it: raise CancelFitException()

    def finish(self):
        "(The owner, as the fit ends or is left) The finder as it was"
        self.ga.remove_window_listener(self._window_closed)
        self.finder.num_it,self.finder.scheds = self.num_it,self.scheds
