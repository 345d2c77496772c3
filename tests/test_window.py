"""The window owns the accumulation rule (issue 39): training, `check_accumulation()` and `learn.noise_scale()` all
accumulate by `Window`'s methods, so a change to the rule shows in all three; the window's phases; the package changes
fastai's `Learner` class only by adding names, and its top level holds what users call"""
import subprocess, sys, warnings

import pytest
import torch
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback

import accum_callback
from accum_callback import GradientAccumulation
from accum_callback.window.state import Phase, StepRecord, Window
from helpers import make_data, make_learner, flat, rel_err

def _uneven():
    "20 items in loader batches of 6: micro-batches of 6, 6, 6 and 2 items, one window of 4 (weights matter)"
    x,y = make_data(20, seed=3).tensors
    return TensorDataset(x.double(), y.double())

def _trained(n_epoch=1):
    learn = make_learner(_uneven(), 6, cbs=[GradientAccumulation(n_step=4)], dtype=torch.float64, lr=0.1)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore'); learn.fit(n_epoch)
    return flat([p.detach() for p in learn.model.parameters()])

def _big_batch():
    "The same step with one batch of the 20 items: the oracle"
    learn = make_learner(_uneven(), 20, dtype=torch.float64, lr=0.1)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore'); learn.fit(1)
    return flat([p.detach() for p in learn.model.parameters()])

def _measured():
    "(check's relative error, noise scale's mean |G|^2) on the untrained Learner"
    learn = make_learner(_uneven(), 6, cbs=[GradientAccumulation(n_step=4)], dtype=torch.float64, lr=0.1)
    rep = learn.check_accumulation()
    ns = learn.noise_scale(n_windows=3, n_step=3)
    return rep.rel_error, ns.g2

def test_one_rule_swapped_changes_training_the_check_and_the_noise_scale(monkeypatch):
    big = _big_batch()
    base_w,(base_err,base_g2) = _trained(),_measured()
    assert rel_err(base_w, big) < 1e-12 and base_err < 1e-10   # the rule as shipped: the large batch's step
    # another rule: every micro-batch weighs twice its share (the noise scale's windows are of whole loader batches, on
    # which fastai's rule of equal weights is ours: a rule that differs on every window)
    monkeypatch.setattr(Window, 'loss_weight', lambda self, n: 2*n/self.ref)
    swapped_w,(swapped_err,swapped_g2) = _trained(),_measured()
    assert rel_err(swapped_w, big) > 1e-3, 'training does not use Window.loss_weight'
    assert swapped_err > 1e-3, 'check_accumulation does not accumulate by Window.loss_weight'
    assert abs(swapped_g2 - base_g2) > 1e-3*abs(base_g2), 'noise_scale does not accumulate by Window.loss_weight'

def test_the_step_scale_is_the_windows_too(monkeypatch):
    base_err = _measured()[0]
    monkeypatch.setattr(Window, 'step_scale', lambda self, items, world=1: 1.)   # no scaling: a sum of weighted means
    assert rel_err(_trained(), _big_batch()) > 1e-3 and _measured()[0] > 1e-3 > base_err

def test_the_rule_in_numbers():
    w = Window(); w.begin(torch.tensor(3.), summed=False)
    assert float(w.loss_weight(torch.tensor(1.))) == pytest.approx(1/3) and w.step_scale(4) == pytest.approx(0.75)
    assert float(w.mean_factor(torch.tensor(1.))) == pytest.approx(3.)
    w.begin(0, summed=False); assert w.ref == 1   # a first micro-batch of no items: the reference is 1, never 0
    s = Window(); s.begin(5, summed=True)
    assert s.loss_weight(5) == 1. and s.step_scale(10, world=2) == 2. and s.mean_factor(10) == pytest.approx(0.1)
    d = Window(); d.begin(3, summed=False, shared=8)   # DDP: every rank the same reference
    assert d.ref == 8. and d.step_scale(32, world=2) == pytest.approx(0.5)

class PhaseSpy(Callback):
    "The window's phase at each event after GradientAccumulation's, per micro-batch"
    order,run_valid = GradientAccumulation.order + 1,False
    def before_fit(self): self.seen = []
    def _log(self, e): w = self.learn.gradient_accumulation.window; self.seen.append((e, w.phase, w.action, w.counted))
    def after_backward(self): self._log('after_backward')
    def before_step(self): self._log('before_step')
    def after_step(self): self._log('after_step')
    def after_batch(self): self._log('after_batch')

def test_phases_follow_the_table():
    spy = PhaseSpy()
    learn = make_learner(_uneven(), 6, cbs=[GradientAccumulation(n_step=2), spy], dtype=torch.float64)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    R,I,S,C = Phase.RUNNING,Phase.IDLE,Phase.STEPPING,Phase.CLOSED
    # micro-batch 1 keeps the window open (its `before_step` is cancelled before this spy's); micro-batch 2 closes it:
    # stepping at `before_step`, closed after the step, idle once the batch ends
    window = [('after_backward', R, None, True), ('after_batch', I, None, True),
              ('after_backward', R, 'step', True), ('before_step', S, 'step', True), ('after_step', C, 'step', True),
              ('after_batch', I, None, True)]
    assert spy.seen == window*2
    ga = learn.gradient_accumulation
    assert ga.window.phase is Phase.IDLE and not ga.window.is_open and ga.window_sizes == [12, 8]

def test_step_record_is_named():
    w = Window(); w.begin(2, summed=False); w.add(2, 2, torch.tensor(0.5)); w.add(2, 2, torch.tensor(1.5))
    w.stepping(4., w.loss_sum)
    assert isinstance(w.record, StepRecord) and w.record.samples == 4 and w.record.micro == 2
    assert float(w.record.loss) == pytest.approx(1.0) and w.phase is Phase.STEPPING
    snap = w.snapshot(); w.close(); assert w.phase is Phase.CLOSED and not w.is_open
    w.restore(snap); assert w.n_micro == 2 and w.record.items == 4.

def test_import_leaves_fastais_learner_methods_as_they_are():
    code = ("from fastai.learner import Learner\n"
            "before = {k: Learner.__dict__[k] for k in ('save', 'load', 'export', 'fit', 'one_batch')}\n"
            "import accum_callback; accum_callback.GradientAccumulation; import accum_callback.fsdp\n"
            "print(all(Learner.__dict__[k] is v for k,v in before.items()))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == 'True', out.stdout + out.stderr

def test_fsdp_checkpoints_are_set_on_one_learner_only():
    from accum_callback.fsdp import _CHECKPOINTS
    a = make_learner(_uneven(), 6); b = make_learner(_uneven(), 6)
    a.fsdp_checkpoints()
    assert all(k in a.__dict__ for k in _CHECKPOINTS) and not any(k in b.__dict__ for k in _CHECKPOINTS)
    f = a.save('m')   # unsharded: fastai's save, through the Learner's own method
    b.load('m'); assert torch.equal(flat(a.model.parameters()), flat(b.model.parameters()))
    f.unlink()

def test_the_top_level_holds_what_users_call_only():
    "At most 12 names users call, and the options objects of `BatchNormAccumulation`'s modes (given as its `mode`)"
    options = {'Freeze', 'Groups', 'Renorm'}
    assert options <= set(accum_callback.__all__) and len(set(accum_callback.__all__) - options) <= 12
    assert 'GradientAccumulation' in accum_callback.__all__
    with pytest.raises(AttributeError): accum_callback.PooledStats   # (0.2's top level: its module now)
    with pytest.raises(AttributeError): accum_callback.NoSuchName
