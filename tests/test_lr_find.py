"""(Module `window.lr_find`.) `lr_find` under accumulation: a rate per optimizer step (`num_it` counts steps), one
recorded loss per window (its item-weighted mean, smoothed as fastai smooths a batch's), the early stop and the
suggestion on those, the fit's epochs enough for `num_it` steps. The oracle: the plain Learner whose batch is the
window (the same samples, float64), whose recorded rates and losses are the accumulated run's."""
import warnings

import pytest
import torch
from fastai.callback.core import Callback
import fastai.callback.schedule  # noqa: F401  (lr_find)

from accum_callback import GradientAccumulation, MicroBatching
from accum_callback.window.lr_find import WindowedLRFinder
from helpers import make_learner, make_data

class Steps(Callback):
    "The optimizer steps taken (`after_step` runs only where a window steps)"
    order = 99
    def before_fit(self): self.n = 0
    def after_step(self): self.n += 1

def found(cbs, bs, n=96, **kw):
    learn = make_learner(make_data(n, seed=4), bs, cbs=cbs + [s := Steps()], lr=1e-2, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        sug = learn.lr_find(show_plot=False, **kw)
    return learn,sug,s.n

CUTS = {'n_step': (lambda: [GradientAccumulation(n_step=4)], 4),
        'micro_bs': (lambda: [GradientAccumulation(n_step=1), MicroBatching(4)], 16),
        'target_bs': (lambda: [GradientAccumulation(target_bs=16)], 8)}

@pytest.mark.parametrize('cut', list(CUTS))
def test_num_it_counts_optimizer_steps(cut):
    "20 rates, one an optimizer step, each recorded once: as many as a plain Learner's 20 batches"
    make,bs = CUTS[cut]
    learn,_,steps = found(make(), bs, num_it=20, stop_div=False)
    lrs = learn.recorder.lrs
    assert steps == 20 and len(lrs) == len(learn.recorder.losses) == 20 and len(set(lrs)) == 20
    assert not any(isinstance(c, WindowedLRFinder) for c in learn.cbs)

@pytest.mark.parametrize('cut', list(CUTS))
@pytest.mark.parametrize('stop_div', [False, True])
def test_each_window_records_its_mean_loss_as_the_large_batch_does(cut, stop_div):
    """The recorded rates equal the plain Learner's at bs 16 (the window), the recorded losses its batch losses
    smoothed (float64: within 1e-12 relative, where the two differ only by the order of summation), the early stop
    at the same step and so the same suggestion"""
    make,bs = CUTS[cut]
    ref,ref_sug,ref_steps = found([], 16, num_it=60, stop_div=stop_div)
    learn,sug,steps = found(make(), bs, num_it=60, stop_div=stop_div)
    assert steps == ref_steps and learn.recorder.lrs == ref.recorder.lrs
    a,b = torch.stack(list(learn.recorder.losses)),torch.stack(list(ref.recorder.losses))
    assert float(((a - b).abs()/b.abs()).max()) < 1e-12
    assert sug.valley == pytest.approx(ref_sug.valley, rel=1e-12)

@pytest.mark.parametrize('cut', list(CUTS))
def test_the_bars_total_is_the_epochs_num_it_steps_take(cut):
    "fastai's rule (num_it // batches an epoch + 1) in optimizer steps: the plain Learner's at the window's size"
    make,bs = CUTS[cut]
    ref,_,_ = found([], 16, num_it=30, stop_div=False)
    learn,_,_ = found(make(), bs, num_it=30, stop_div=False)
    assert learn.n_epoch == ref.n_epoch == 30//(96//16) + 1

def test_a_fit_after_lr_find_accumulates_as_before():
    "The finder's schedules and count are its own again; the next fit steps once a window"
    learn,_,_ = found([GradientAccumulation(n_step=4)], 4, num_it=10)
    learn.add_cb(s := Steps())
    with learn.no_logging(): learn.fit(1)
    assert s.n == -(-len(learn.dls.train)//4)
