"""The window plan (`accum_callback.window.plan`, issue 53): the window's size from its schedule, the rule that closes it, the
schedule's clock in windows and the step's learning-rate gain, a declared method of the window schedule (1 unless the
schedule says otherwise). Each is checked against what it stands for: the windows an epoch takes, the large batch's
step a window stands for, and the trained weights of a gain against the same run with the learning rate scaled by hand.
Also: `micro_bs`'s `MicroBatching` joins and leaves with its `GradientAccumulation` without fastai's `learn` being
overridden on either class."""
import warnings

import pytest
import torch
from fastai.callback.core import Callback

from accum_callback import GradientAccumulation, MicroBatching, WindowSchedule
from accum_callback.window.plan import WindowPlan
from accum_callback.window.schedule import windows_started
from accum_callback.window.state import Window
from helpers import make_data, make_learner, fit_quiet, flat, rel_err

F64 = torch.float64

class _Learn:
    "What the plan reads of a Learner: the loader's batch size, the epoch, and fastai's clock"
    def __init__(self, bs=4, epoch=0, n_epoch=2):
        self.dls = type('D', (), dict(train=type('T', (), dict(bs=bs))()))()
        self.epoch,self.n_epoch,self.pct_train = epoch,n_epoch,0.

@pytest.mark.parametrize('kw,sizes,expect', [
    (dict(n_step=3), [4]*7, ['step' if i in (2, 5, 6) else None for i in range(7)]),   # a partial last window steps
    (dict(target_bs=10, partial='drop'), [4]*7, [None, None, 'step', None, None, 'step', 'drop']),
    (dict(target_bs=10), [4, 4, 1, 4, 4], [None, None, None, 'step', 'step'])])        # items (9 < 10 after three), not batches
def test_the_plan_closes_windows_by_its_rule(kw, sizes, expect):
    "Which unit closes its window (and how), fed unit by unit as `GradientAccumulation` feeds it; last epoch not reached"
    plan,learn,units,seen,got = WindowPlan(**kw),_Learn(),0,0,[]
    for i,b in enumerate(sizes):
        if not units: target = plan.window_starts(learn)
        a = plan.decide(learn, target, b, units, seen, i == len(sizes)-1, ddp=False)
        got.append(a)
        units,seen = (0,0) if a else (units+1,seen+b)
    assert got == expect

def test_the_clock_puts_each_window_at_the_large_batchs_step():
    "W windows step in an epoch: window j's step uses fastai's schedule at pct (epoch + j/W)/n_epoch, whatever its micro-batches"
    plan,learn = WindowPlan(n_step=3),_Learn(epoch=1, n_epoch=2)
    sizes = [4]*8   # windows of 3, 3, 2
    plan.start_epoch(learn, [torch.zeros(b) for b in sizes], 0, 0, ddp=False)
    assert plan.clock.W == windows_started(sizes, 3, False, 'step', True) == 3
    pcts = []
    for _ in range(3): plan.window_starts(learn); pcts.append(learn.pct_train)
    assert pcts == pytest.approx([(1+j/3)/2 for j in range(3)], abs=1e-12)

def test_micro_batches_a_window_takes():
    plan,w = WindowPlan(target_bs=10),Window()
    assert plan.micro_batches(w, 4) == 3   # ceil(10/4)
    w.target = 17
    assert plan.micro_batches(w, 4) == 5 and WindowPlan(n_step=5).micro_batches(Window(), 4) == 5

class _Doubling(WindowSchedule):
    "A window schedule that declares a gain: twice the learning rate for a window of 2 micro-batches or more"
    def __init__(self): super().__init__(2, 'n_step')
    def lr_gain(self, size, opt=None): return 2. if size >= 2 else 1.

def _lr_seen(learn):
    class Seen(Callback):
        order = 100
        def before_step(self): self.lrs.append(self.opt.hypers[0]['lr'])
    s = Seen(); s.lrs = []
    learn.add_cb(s)
    return s.lrs

def test_the_gain_is_a_declared_method_of_the_schedule():
    """The default gain is 1 (the step keeps the schedule's rate); a schedule that declares `lr_gain` has its steps taken
    at that multiple of the rate, put back after the step: the weights equal a run at twice the rate to 1e-12"""
    assert WindowSchedule(4, 'n_step').lr_gain(4) == 1. and WindowSchedule({0: 2}, 'n_step').lr_gain(2) == 1.
    ds = make_data(16)
    def run(sched, lr):
        learn = make_learner(ds, 4, cbs=[GradientAccumulation(n_step=sched)], dtype=F64, lr=lr)
        lrs = _lr_seen(learn)
        fit_quiet(learn, 1)
        return flat([p.detach() for p in learn.model.parameters()]),lrs,learn.opt.hypers[0]['lr']
    got,lrs,after = run(_Doubling(), 0.05)
    ref,_,_ = run(2, 0.1)
    assert lrs == [0.1, 0.1] and after == 0.05 and rel_err(got, ref) <= 1e-12

def test_a_noise_scale_schedule_is_a_window_schedule():
    from accum_callback.noise.scale import GradientNoiseScale
    s = GradientNoiseScale().schedule(lo=8, lr='linear')
    assert isinstance(s, WindowSchedule) and not s.per_epoch and s.constant is None and s.lr_gain(16) == 2.
    assert GradientAccumulation(target_bs=s).plan.sched is s

# -- learn.accumulate(micro_bs=): the MicroBatching beside the window ---------------------------------------------------------------------------
def test_accumulate_micro_bs_puts_one_micro_batching_beside_the_window():
    """`learn.accumulate(micro_bs=4)`: one `GradientAccumulation` (one step a loader batch unless a window is given) and
    one `MicroBatching(4)`, replacing those there; without `micro_bs` a `MicroBatching` added by hand stays. Neither
    class redefines fastai's `learn`"""
    assert 'learn' not in GradientAccumulation.__dict__ and 'learn' not in MicroBatching.__dict__
    def ours(learn): return sorted(type(c).__name__ for c in learn.cbs if isinstance(c, (GradientAccumulation, MicroBatching)))
    learn = make_learner(make_data(24), 8, cbs=[MicroBatching(2), GradientAccumulation(n_step=3)])
    learn.accumulate(n_step=2, micro_bs=4)
    assert ours(learn) == ['GradientAccumulation', 'MicroBatching'] and learn.micro_batching.size == 4
    fit_quiet(learn, 1)
    assert learn.gradient_accumulation.window_sizes == [16, 8] and learn.gradient_accumulation.window_micro == [4, 2]
    learn.accumulate(micro_bs=4)
    fit_quiet(learn, 1)
    assert learn.gradient_accumulation.window_sizes == [8]*3 and learn.gradient_accumulation.window_micro == [2]*3
    learn.accumulate(n_step=3)
    assert ours(learn) == ['GradientAccumulation', 'MicroBatching']
