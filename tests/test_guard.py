"""`accum_callback.core.protocols`: the fit's clean-up guard on the epoch level, `fail_fit`, twins refused naming what to do with
`learn.<name>` kept on the first, and the refusal protocol (`refuse_fit()`, ours or a user's, before anything is set up)"""
import pytest
import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.learner import Learner

from accum_callback import GradientAccumulation
from accum_callback.core.protocols import FitGuard, add_fit_guard, fail_fit, in_inference, refuse_at_fit_start, remove_fit_guard
from helpers import make_data, make_learner

def test_the_guard_runs_cleanups_for_an_exception_leaving_an_epoch_then_goes():
    learn = make_learner(make_data(16), 4)
    seen = []
    class Raise(Callback):
        def before_fit(self): add_fit_guard(self.learn, 'k', lambda e: seen.append(type(e).__name__))
        def after_epoch(self): raise KeyboardInterrupt
    learn.add_cb(Raise())
    with learn.no_logging(), pytest.raises(KeyboardInterrupt): learn.fit(1)
    assert seen == ['KeyboardInterrupt'] and '_with_events' not in learn.__dict__

def test_a_cancelled_fit_calls_the_cleanups_and_keeps_the_guard_until_after_fit():
    learn = make_learner(make_data(16), 4)
    seen,at_after_fit = [],[]
    class Cancel(Callback):
        def before_fit(self): add_fit_guard(self.learn, 'k', lambda e: seen.append(type(e).__name__))
        def before_epoch(self): raise CancelFitException
        def after_fit(self): at_after_fit.append(isinstance(self.learn.__dict__.get('_with_events'), FitGuard)); remove_fit_guard(self.learn, 'k')
    learn.add_cb(Cancel())
    with learn.no_logging(): learn.fit(1)
    assert seen == ['CancelFitException'] and at_after_fit == [True] and '_with_events' not in learn.__dict__

def test_fail_fit_runs_every_cleanup_now():
    learn = make_learner(make_data(16), 4)
    seen = []
    add_fit_guard(learn, 'a', lambda e: seen.append('a')); add_fit_guard(learn, 'b', lambda e: seen.append('b'))
    fail_fit(learn, ValueError('refused'))
    assert seen == ['a', 'b'] and '_with_events' not in learn.__dict__
    fail_fit(learn, ValueError('again'))   # (no guard: nothing to do)

def test_twins_are_refused_and_the_next_fit_names_the_first():
    """Two of one callback of ours: refused at fit start in one message; fastai's `remove_cb` of the refused twin
    deletes the name both answer to, and the next fit start names the Learner's own again (fastai's `Callback.name`
    is not redefined)"""
    first = GradientAccumulation(n_step=2)
    learn = make_learner(make_data(16), 4, cbs=[first])
    with learn.no_logging(), pytest.raises(ValueError, match=r"(?s)2 `GradientAccumulation` callbacks .*learn.remove_cb\(learn.cbs\["):
        learn.fit(1, cbs=[GradientAccumulation(n_step=3)])
    assert [c for c in learn.cbs if isinstance(c, GradientAccumulation)] == [first] and 'name' not in vars(GradientAccumulation)
    with learn.no_logging(), learn.no_bar(): learn.fit(1)
    assert learn.gradient_accumulation is first and 'gradient_accumulation' not in vars(Learner)

def test_refuse_fit_is_a_protocol_any_callback_can_join():
    class Mine(Callback):
        order = 50   # (after ours: the first of ours asks every callback before anything is set up)
        def refuse_fit(self): raise ValueError('Mine: not with this loader')
        def before_fit(self): raise AssertionError('set up before the refusal')
    learn = make_learner(make_data(16), 4, cbs=[GradientAccumulation(n_step=2), Mine()])
    w = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_logging(), pytest.raises(ValueError, match='Mine: not with this loader'): learn.fit(1)
    assert all(torch.equal(a, b) for a,b in zip(w, learn.model.parameters())) and not in_inference(learn)
