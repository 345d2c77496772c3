"Window-size schedules: windows follow the schedule exactly, every step stays exact, bad schedules fail at construction"
import warnings
import pytest, torch
from hypothesis import given, settings, strategies as st, HealthCheck
from fastai.callback.schedule import SchedLin, SchedExp, SchedCos, combine_scheds

from accum_callback import GradientAccumulation, WindowSchedule, batch_growth_from_lr
from helpers import accumulation, WindowSpy, fit_quiet, make_data, make_learner

TOL = 1e-6

def expected(n, bs, n_epoch, sched, by_items=False):
    "Windows (samples, micro-batches) written from the contract: a value read at each window start, held to its end"
    batches = [bs]*(n//bs) + ([n % bs] if n % bs else [])
    n_iter = len(batches); out = []; cur = k = 0; target = None
    for e in range(n_epoch):
        for i, b in enumerate(batches):
            if k == 0: target = sched((e*n_iter+i)/(n_iter*n_epoch), e)
            cur += b; k += 1
            if (cur >= target if by_items else k >= target) or i == n_iter-1: out.append((cur, k)); cur = k = 0
    return out

def run(n, bs, n_epoch, **kw):
    spy = WindowSpy()
    learn = make_learner(make_data(n), bs, cbs=[*accumulation(**kw), spy], dtype=torch.float64)
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); fit_quiet(learn, n_epoch)
    return learn.gradient_accumulation, spy

@pytest.mark.parametrize('kw,by_items', [
    (dict(n_step={0: 1, 1: 3, 2: 5}), False),
    (dict(n_step=SchedLin(1, 6)), False),
    (dict(n_step=combine_scheds([0.3, 0.7], [SchedLin(1, 1), SchedExp(2, 8)])), False),
    (dict(target_bs={0: 4, 2: 20}), True),
    (dict(target_bs=SchedCos(3, 30)), True),
])
def test_windows_follow_the_schedule_and_stay_exact(kw, by_items):
    ga, spy = run(50, 4, 3, **kw)
    exp = expected(50, 4, 3, ga.plan.sched, by_items)
    assert list(zip(ga.window_sizes, ga.window_micro)) == exp
    assert len(set(ga.window_micro)) > 1                 # the window really changed size
    assert max(spy.errs) <= TOL, spy.errs

@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(e1=st.integers(1, 6), e2=st.integers(1, 6), bs=st.integers(1, 7), n=st.integers(5, 40))
def test_property_epoch_mapping(e1, e2, bs, n):
    ga, spy = run(n, bs, 2, n_step={0: e1, 1: e2})
    assert list(zip(ga.window_sizes, ga.window_micro)) == expected(n, bs, 2, ga.plan.sched)
    assert all(e <= TOL for e in spy.errs)

def test_new_value_waits_for_the_next_window():
    "A change in the middle of a window never splits it: the window opened with 4 closes at 4"
    ga, _ = run(40, 2, 2, n_step=lambda p: 4 if p < 0.33 else 2)   # 40 micro-batches; the value changes at 13.2
    assert ga.window_micro == [4, 4, 4, 4] + [2]*12                 # the window opened at 12 keeps 4

@pytest.mark.parametrize('kw,exc,match', [
    (dict(n_step={0: 0}), ValueError, 'n_step.*>= 1'),
    (dict(n_step={0: -2}), ValueError, 'n_step'),
    (dict(n_step={0: 2, 3: 2.5}), TypeError, 'n_step.*epoch 3'),
    (dict(n_step={1: 2}), ValueError, 'epoch 0'),
    (dict(n_step={}), ValueError, 'empty'),
    (dict(n_step={-1: 2, 0: 2}), TypeError, 'epochs'),
    (dict(target_bs=lambda p: 4 - 8*p), ValueError, 'target_bs.*rounds to'),
    (dict(n_step=lambda p: float('nan')), ValueError, 'n_step'),
    (dict(n_step=lambda p: 1/0), ValueError, 'n_step.*failed'),
])
def test_bad_schedules_fail_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match): GradientAccumulation(**kw)

def test_effective_batch_recorded_per_step():
    ga, _ = run(32, 4, 2, n_step={0: 2, 1: 4})
    assert ga.window_sizes == [8]*4 + [16]*2

def test_batch_growth_from_lr():
    assert batch_growth_from_lr({0: 0.1, 2: 0.02, 4: 0.001}, base=2, max_value=16) == {0: 2, 2: 10, 4: 16}
    f = batch_growth_from_lr(SchedExp(1e-2, 1e-3), base=2, max_value=8)
    assert f(0.) == 2 and f(1.) == 8 and f(0.3) == round(2*10**0.3)
    GradientAccumulation(n_step=f)                         # a valid schedule
    with pytest.raises(ValueError, match='lr_sched'): batch_growth_from_lr(SchedLin(1e-2, 0.), base=2)
    with pytest.raises(ValueError, match='base'): batch_growth_from_lr({0: 0.1}, base=0)
    with pytest.raises(TypeError, match='lr_sched'): batch_growth_from_lr(0.1, base=2)
