"""`accum_callback.window.advice`: what `GradientAccumulation` says once at fit start about settings that may not mean what the
user meant, each warning naming the argument and what to do, none changing what training does"""
import warnings
import pytest
import torch.nn as nn

from accum_callback import GradientAccumulation
from helpers import accumulation, fit_quiet, make_data, make_learner

# -- settings under which nothing accumulates (issue 41, 44) ---------------------------------------------------------------
@pytest.mark.parametrize('kw,match', [
    (dict(micro_bs=16), r"MicroBatching\(16\) is larger than the loader's batch \(8\): no batch is cut"),
    (dict(target_bs=4), r"target_bs=4 is below the loader's batch \(8\).*nothing accumulates.*bs/target_bs = 2"),
    (dict(target_bs=2, partial='carry'), r"target_bs=2 is below the loader's batch \(8\).*nothing accumulates.*bs/target_bs = 4"),
])
def test_a_setting_that_accumulates_nothing_says_so(kw, match):
    """`MicroBatching(16)` with loader batches of 8 accumulated nothing, silently; `target_bs=4` warned '8 does not divide
    target_bs=4'; fastai's `n_acc=2` at bs 8 ("simulating" a larger batch) steps every batch. One warning naming it"""
    learn = make_learner(make_data(64), 8, cbs=[*accumulation(**kw)])
    with pytest.warns(UserWarning, match=match) as w: fit_quiet(learn, 1)
    assert sum('GradientAccumulation' in str(x.message) for x in w) == 1
    assert learn.gradient_accumulation.steps == 8   # every loader batch its own step

def test_a_window_over_most_of_the_epoch_is_said_once_a_fit():
    learn = make_learner(make_data(64), 8, cbs=[GradientAccumulation(n_step=6)])
    with pytest.warns(UserWarning, match=r"GradientAccumulation: n_step=6 makes a window of 6 of the epoch's 8 ") as w:
        fit_quiet(learn, 1)
    assert sum('GradientAccumulation' in str(x.message) for x in w) == 1
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # (said once: a second fit of the same callback says nothing)
        fit_quiet(learn, 1)

def test_what_training_does_is_the_same_with_or_without_the_warning():
    "The advice changes nothing: the steps of a warned setting are those of the same setting said already"
    a = make_learner(make_data(64), 8, cbs=[GradientAccumulation(n_step=6)])
    b = make_learner(make_data(64), 8, cbs=[GradientAccumulation(n_step=6)])
    b.gradient_accumulation.said.add('window')
    with pytest.warns(UserWarning, match='n_step=6 makes a window'): fit_quiet(a, 1)
    with warnings.catch_warnings():
        warnings.simplefilter('error'); fit_quiet(b, 1)
    assert a.gradient_accumulation.window_sizes == b.gradient_accumulation.window_sizes
    assert all((p == q).all() for p,q in zip(a.model.parameters(), b.model.parameters()))

# -- an epoch shorter than the window (Lightning #21808's complaint) -------------------------------------------------------
@pytest.mark.parametrize('n', [5, 7])
def test_an_epoch_shorter_than_the_window_is_said_with_what_to_do(n):
    """n_step=8 on an epoch of 5 (or 7) loader batches: every window is the epoch, cut short; said once, naming n_step
    and what to do (a smaller n_step, or partial='carry'); with partial='carry' the windows are whole and nothing is said"""
    learn = make_learner(make_data(8*n), 8, cbs=[GradientAccumulation(n_step=8)])
    with pytest.warns(UserWarning, match=rf"epoch \({n} loader batches of 8\) is shorter than the window of n_step=8.*"
                                         rf"smaller n_step \(at most {n}\), or partial='carry'") as w:
        fit_quiet(learn, 1)
    assert sum('GradientAccumulation' in str(x.message) for x in w) == 1
    assert learn.gradient_accumulation.window_sizes == [8*n]   # (items: the whole epoch, one step)
    carried = make_learner(make_data(8*n), 8, cbs=[GradientAccumulation(n_step=8, partial='carry')])
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)
        fit_quiet(carried, 2)
