"""`GradientAccumulation(micro_bs=...)`: loader batches cut into micro-batches, and 'auto' with out-of-memory retries.
Each run is compared with the one-large-batch run on the same samples (float64: "equal" is 1e-10 relative, seen ~1e-16),
or with a fixed micro-batch of the size 'auto' found. Out-of-memory errors are simulated on the CPU: a loss or a module
that raises `torch.OutOfMemoryError` above N items, or once at a chosen call."""
import warnings
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from fastai.callback.core import Callback
from fastai.callback.schedule import fit_one_cycle   # noqa: F401

from accum_callback import GradientAccumulation, BatchNormAccumulation, Groups, MicroBatching
from accum_callback.testing import OutOfMemoryAbove
from helpers import (accumulation, MLP, Float64Smoothing, as64, as_float64, fit_floor, fit_quiet, floor_tol, forward_floor,
                     make_data, make_learner, rel_err, weights_of)

TOL = 1e-10
F64 = torch.float64

def weights(learn): return torch.cat([p.detach().reshape(-1) for p in learn.model.parameters()])

def bn_buffers(learn): return [b.detach().clone() for n,b in learn.model.named_buffers()]

OOMAbove = OutOfMemoryAbove   # a training loss refusing a micro-batch of more than n items (what a GPU does)

class BNDropNet(nn.Module):
    "BatchNorm and dropout: the running statistics and the dropout masks must replay exactly after an undone attempt"
    def __init__(self, seed=0, p=0.3):
        super().__init__(); torch.manual_seed(seed)
        self.l1,self.bn,self.drop,self.l2 = nn.Linear(5, 16),nn.BatchNorm1d(16),nn.Dropout(p),nn.Linear(16, 3)
    def forward(self, x): return self.l2(self.drop(torch.tanh(self.bn(self.l1(x)))))

class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        FailOnce.calls += 1
        if FailOnce.calls == FailOnce.at: raise torch.OutOfMemoryError('CUDA out of memory (simulated, in backward)')
        return g

class FailOnce(nn.Module):
    "Raises out of memory once, in the backward of its `at`-th call: the gradients of the layers after it are half-accumulated then"
    calls,at = 0,None
    def forward(self, x): return _FailBackward.apply(x)

class BackwardNet(nn.Module):
    def __init__(self, seed=0, bn=True):
        super().__init__(); torch.manual_seed(seed)
        self.l1,self.bn,self.fail,self.l2 = nn.Linear(5, 16),nn.BatchNorm1d(16) if bn else nn.Identity(),FailOnce(),nn.Linear(16, 3)
    def forward(self, x): return self.l2(self.fail(torch.tanh(self.bn(self.l1(x)))))

def run(ds, bs, cbs, model=None, loss_func=F.mse_loss, epochs=2, one_cycle=False, lr=0.1):
    learn = make_learner(ds, bs, cbs=cbs, model=model, loss_func=loss_func, dtype=F64, lr=lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging():
            learn.fit_one_cycle(epochs, lr) if one_cycle else learn.fit(epochs, lr)
    learn.caught = [str(w.message) for w in caught]
    return learn

# -- fixed micro_bs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('bs,micro_bs,ga', [(10, 4, {}), (10, 3, dict(n_step=2)), (8, 8, dict(n_step=2)),
                                            (6, 4, dict(target_bs=12)), (7, 2, dict(n_step=3, partial='drop'))])
def test_fixed_micro_bs_equals_unsplit_run(bs, micro_bs, ga):
    """Cutting loader batches into micro-batches changes nothing: the same windows, steps and weights as the unsplit
    run (one step per loader batch without n_step/target_bs), one-cycle schedule included"""
    ds = make_data(46)
    ref = run(ds, bs, [GradientAccumulation(**(ga or dict(n_step=1)))], one_cycle=True)
    got = run(ds, bs, [*accumulation(micro_bs=micro_bs, **ga)], one_cycle=True)
    a,b = got.gradient_accumulation,ref.gradient_accumulation
    assert a.window_sizes == b.window_sizes and got.micro_batching.size == micro_bs
    assert max(a.window_micro) == -(-bs//micro_bs)*(ga.get('n_step') or 1) or ga.get('target_bs')
    assert rel_err(weights(got), weights(ref)) <= TOL

def test_pieces_are_near_equal_so_batchnorm_never_sees_one_item():
    """16 items at micro_bs 5 are cut 4, 4, 4, 4 (not 5, 5, 5, 1: BatchNorm cannot train on one item, which made such a
    fit raise), 10 are cut 5, 5: as many pieces as micro_bs asks, none larger"""
    seen = []
    class Sizes(Callback):
        run_valid = False
        def after_pred(self): seen.append(len(self.yb[0]))
    ds = make_data(26)
    learn = run(ds, 16, [GradientAccumulation(n_step=1), MicroBatching(5), Sizes()], model=BNDropNet(p=0.), epochs=1)
    assert seen == [4, 4, 4, 4, 5, 5] and learn.gradient_accumulation.window_sizes == [16, 10]
    assert max(learn.gradient_accumulation.window_micro) == 4

def test_fixed_micro_bs_pool_statistics_of_the_whole_window():
    "'pool' with micro_bs: the running statistics the unsplit loader batch leaves (one update per window)"
    ds = make_data(40)
    mk = lambda cbs: run(ds, 8, cbs + [BatchNormAccumulation('pool')], model=BNDropNet(p=0.), lr=0.)
    ref = run(ds, 8, [], model=BNDropNet(p=0.), lr=0.)   # plain BatchNorm on the whole loader batch
    got = mk([GradientAccumulation(n_step=1), MicroBatching(3)])
    for a,b in zip(bn_buffers(got), bn_buffers(ref)): assert rel_err(a.double(), b.double()) <= TOL

# -- micro_bs='auto' ------------------------------------------------------------------------------------------------
def test_auto_halves_until_it_fits_and_equals_the_fixed_size_and_the_big_batch():
    "OOM above 5 items: 16 -> 8 -> 4; every step is the big batch's, and equals a fixed micro_bs=4 run, dropout and BatchNorm included"
    ds = make_data(64)
    oom = OOMAbove(5)
    auto = run(ds, 16, [GradientAccumulation(n_step=1), MicroBatching('auto')], model=BNDropNet(), loss_func=oom)
    fixed = run(ds, 16, [GradientAccumulation(n_step=1), MicroBatching(4)], model=BNDropNet())
    ga = auto.gradient_accumulation
    assert auto.micro_batching.size == 4 and ga.window_sizes == fixed.gradient_accumulation.window_sizes == [16]*8
    assert oom.calls[:3] == [16, 8, 4] and max(oom.calls[3:]) == 4   # the size found is kept
    assert rel_err(weights(auto), weights(fixed)) <= TOL   # dropout masks replayed: the RNG was put back
    for a,b in zip(bn_buffers(auto), bn_buffers(fixed)): assert torch.equal(a, b)   # running stats, num_batches_tracked
    msgs = [m for m in auto.caught if 'out of memory' in m]
    assert len(msgs) == 2 and 'micro_bs is now 8' in msgs[0] and 'micro_bs is now 4' in msgs[1]
    # without dropout: the big batch itself
    ds2 = make_data(64, seed=1)
    auto = run(ds2, 16, [GradientAccumulation(n_step=1), MicroBatching('auto')], model=MLP(), loss_func=OOMAbove(5))
    big = run(ds2, 16, [], model=MLP())
    assert rel_err(weights(auto), weights(big)) <= TOL

def test_auto_keeps_the_size_for_the_next_fit():
    ds = make_data(32)
    learn = run(ds, 16, [GradientAccumulation(n_step=1), MicroBatching('auto')], loss_func=OOMAbove(5), epochs=1)
    oom = learn.loss_func = OOMAbove(5)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert learn.micro_batching.size == 4 and set(oom.calls) == {4}

def test_oom_in_the_backward_mid_window_is_undone():
    """Out of memory in the backward of the 2nd micro-batch of a window (n_step 2, loader batches of 8, auto starts at
    8): the first loader batch's gradient and part of this one's were accumulated then. Undone and retried at 4: the
    big batch's steps; with 'pool' (lr 0) the big batch's running statistics"""
    ds = make_data(48)
    for bn,lr in ((False, 0.1), (True, 0.)):
        FailOnce.calls,FailOnce.at = 0,4
        cbs = [GradientAccumulation(n_step=2), MicroBatching('auto')] + ([BatchNormAccumulation('pool')] if bn else [])
        auto = run(ds, 8, cbs, model=BackwardNet(bn=bn), lr=lr)
        FailOnce.at = None
        big = run(ds, 16, [], model=BackwardNet(bn=bn), lr=lr)
        ga = auto.gradient_accumulation
        assert auto.micro_batching.size == 4 and ga.window_sizes == [16]*6 and ga.window_micro[:3] == [2, 3, 4]
        assert rel_err(weights(auto), weights(big)) <= TOL
        for a,b in zip(bn_buffers(auto), bn_buffers(big)): assert rel_err(a.double(), b.double()) <= TOL

def test_size_one_raises_a_clear_error_and_leaves_the_learner_clean():
    ds = make_data(16)
    learn = make_learner(ds, 4, cbs=[GradientAccumulation(n_step=1), MicroBatching('auto')], loss_func=OOMAbove(0), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with pytest.raises(RuntimeError, match="MicroBatching\\('auto'\\).*micro-batch of 1 item"): fit_quiet(learn, 1)
    assert 'one_batch' not in learn.__dict__ and not isinstance(learn.dl, type(None)) and type(learn.dl).__name__ != 'MicroBatches'
    assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters())

def test_other_errors_propagate_untouched_and_are_not_retried():
    class Boom:
        calls = 0
        def __call__(self, out, targ):
            Boom.calls += 1
            raise ValueError('boom: not a memory error')
    learn = make_learner(make_data(16), 8, cbs=[GradientAccumulation(n_step=1), MicroBatching('auto')], loss_func=Boom(), dtype=F64)
    with pytest.raises(ValueError, match='boom: not a memory error'): fit_quiet(learn, 1)
    assert Boom.calls == 1 and learn.micro_batching.size == 8

@pytest.mark.parametrize('kw,match', [(dict(size=0), 'size'), (dict(size='big'), 'size'), (dict(size=2.5), 'size'),
                                      (dict(size='auto', probe=1), 'probe')])
def test_bad_arguments_name_themselves(kw, match):
    with pytest.raises((ValueError, TypeError), match=match): MicroBatching(**kw)

def test_ready_made_batches_target_bs_and_momentum():
    "A loader of ready-made batches (`bs=None`): target_bs, 'momentum' (reads micro-batches per window) and micro_bs run"
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    ds = make_data(24)
    x,y = ds.tensors
    batches = [(x[i:i+6].double(), y[i:i+6].double()) for i in range(0, 24, 6)]
    dls = DataLoaders(DataLoader(batches, bs=None), DataLoader(batches[:1], bs=None), device='cpu')
    from fastai.learner import Learner
    learn = Learner(dls, BNDropNet(p=0.).double(), loss_func=F.mse_loss, lr=0.1,
                    cbs=[GradientAccumulation(target_bs=12), MicroBatching('auto'), BatchNormAccumulation('momentum'), Float64Smoothing()])
    fit_quiet(learn, 1)
    ga = learn.gradient_accumulation
    assert learn.micro_batching.size == 6 and ga.window_sizes == [12, 12]

def test_probe_keeps_the_faster_neighbour_and_its_verdict(monkeypatch):
    """The probe (GPU only; here with a simulated clock on the CPU): once 8 ran a loader batch, it times 8 and then 4,
    keeps 4 when 4 is faster, says so, and does not probe again in the next fit (re-probing in every fit cost a timed
    epoch a quarter of its speed on an H100); the steps stay the big batch's"""
    speed = {8: 100., 4: 150., 2: 50.}   # simulated items/s per micro-batch size
    clock = [0.]
    def loss(out, targ):
        clock[0] += len(out)/speed[len(out)]   # the micro-batch "takes" this long
        return F.mse_loss(out, targ)
    monkeypatch.setattr(MicroBatching, '_probe_here', lambda self: True)
    monkeypatch.setattr(MicroBatching, '_clock', lambda self: clock[0])
    ds = make_data(48)
    learn = run(ds, 8, [GradientAccumulation(n_step=1), MicroBatching('auto')], loss_func=loss, epochs=1)
    mb = learn.micro_batching
    assert mb.size == 4 and mb.trials == pytest.approx({8: 100., 4: 150.})
    assert any('micro_bs is now 4' in m for m in learn.caught)
    big = run(ds, 8, [], epochs=1)
    assert rel_err(weights(learn), weights(big)) <= TOL
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert mb.size == 4 and len(mb.trials) == 2   # no second probe

def test_probe_keeps_the_larger_size_when_it_is_faster(monkeypatch):
    speed = {8: 200., 4: 150.}
    clock = [0.]
    def loss(out, targ):
        clock[0] += len(out)/speed[len(out)]
        return F.mse_loss(out, targ)
    monkeypatch.setattr(MicroBatching, '_probe_here', lambda self: True)
    monkeypatch.setattr(MicroBatching, '_clock', lambda self: clock[0])
    learn = run(make_data(48), 8, [GradientAccumulation(n_step=1), MicroBatching('auto')], loss_func=loss, epochs=1)
    assert learn.micro_batching.size == 8 and not any('micro_bs is now' in m for m in learn.caught)

# == issue 20: validation under 'auto', stateful models, the progress total, warnings, DDP cancels, cancelled steps ====
from fastai.callback.core import CancelStepException
from fastai.data.core import Datasets
from fastai.data.transforms import Categorize
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy, RocAuc
from fastai.optimizer import SGD
from fastai.torch_core import TensorBase
from accum_callback.micro import StatefulModelError, stateful_modules
from helpers import WindowSpy, flat, lm_learner_factory

class OOMInInference(nn.Module):
    "Raises out of memory for an inference forward of more than `n` items (training passes)"
    def __init__(self, n): super().__init__(); self.n,self.calls = n,[]
    def forward(self, x):
        if not torch.is_grad_enabled():
            self.calls.append(len(x))
            if len(x) > self.n: raise torch.OutOfMemoryError(f'CUDA out of memory (simulated inference: {len(x)} > {self.n})')
        return x

_X,_Y = torch.randn(64, 5, generator=torch.Generator().manual_seed(3)),torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(4))
def _get_x(i): return TensorBase(_X[i])
def _get_y(i): return int(_Y[i])

def clf_learner(n_oom=10**9, cbs=()):
    "A 3-class classifier on fastai `Datasets` (so that `predict` and `tta` work), valid batches of 16"
    dsets = Datasets(range(64), [[_get_x], [_get_y, Categorize()]], splits=[list(range(40)), list(range(40, 64))])
    dls = dsets.dataloaders(bs=8, val_bs=16, device='cpu', shuffle=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), OOMInInference(n_oom), nn.Tanh(), nn.Linear(16, 3))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=0.1, metrics=[accuracy, RocAuc()],
                    cbs=list(cbs))
    return learn

def test_inference_batches_are_cut_under_auto_and_equal_the_uncut_run():
    """Under 'auto' an out-of-memory error in validate, fit's validation, get_preds, predict and tta cuts that batch
    (16 -> 8 -> 4 here) and runs it again: loss and metrics (AvgLoss, AvgMetric accuracy, AccumMetric RocAuc) within 1e-6
    of the uncut run, predictions and targets equal and in order. Training keeps its own size (8: it never ran out)"""
    ref,got = clf_learner(),clf_learner(n_oom=5, cbs=[GradientAccumulation(n_step=1), MicroBatching('auto')])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fit_quiet(ref, 1); fit_quiet(got, 1)   # fit's own validation phase
        va,vb = ref.recorder.values[-1],got.recorder.values[-1]
        a,b = ref.validate(),got.validate()
        pa,pb = ref.get_preds(with_loss=True),got.get_preds(with_loss=True)
        da,db = ref.predict(3),got.predict(3)
        ta,tb = ref.tta(n=2),got.tta(n=2)
    assert got.micro_batching.inference_bs == 4 and got.micro_batching.size == 8
    assert sum('inference batches are now cut into pieces of' in str(w.message) for w in caught) == 2   # 16->8, 8->4 once
    assert max(got.model[1].calls[2:]) <= 4   # the size found is kept
    assert len(va) == 4 and len(a) == 3   # train loss, valid loss, accuracy, roc auc
    tol = floor_tol([forward_floor(ref)])   # float32's rounding on one uncut validation batch
    def close(x, y): return bool((x-y).abs().max() <= tol*y.abs().max())
    for x,y in zip(va + a, vb + b): assert abs(x-y) <= tol*abs(y), (x, y, tol)
    assert close(pb[0], pa[0]) and torch.equal(pa[1], pb[1]) and close(pb[2], pa[2])
    assert da[0] == db[0] and close(db[2], da[2])
    assert close(tb[0], ta[0]) and torch.equal(ta[1], tb[1])
    assert 'one_batch' not in got.__dict__ and 'forward' not in got.model.__dict__   # nothing left behind

def test_inference_of_one_item_that_does_not_fit_is_a_clear_error():
    learn = clf_learner(n_oom=0, cbs=[GradientAccumulation(n_step=1), MicroBatching('auto')])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with pytest.raises(RuntimeError, match="out of memory in inference with a batch of 1 item"): learn.predict(3)
    assert 'one_batch' not in learn.__dict__ and 'forward' not in learn.model.__dict__
    learn.model[1].n = 10**9
    learn.predict(3)   # the Learner still works

def test_fixed_micro_bs_does_not_touch_inference():
    learn = clf_learner(n_oom=5, cbs=[GradientAccumulation(n_step=1), MicroBatching(4)])
    with pytest.raises(torch.OutOfMemoryError): learn.validate()   # the user's loader batch: their error to see

# -- models that carry state between batches ---------------------------------------------------------------------------
@pytest.fixture
def lm_learner(): return lm_learner_factory()

def test_language_model_pieces_run_with_their_own_rows_state(lm_learner):
    """micro_bs=3 on loader batches of 8 rows: each piece starts from its own rows of the carried hidden state and
    writes its rows back, so the fit equals the unsplit one (weights <= 1e-5; before: 1.4e-3 apart, no warning), and
    the validation loss is the same"""
    ref,floor = lm_fit_floor(lm_learner)
    got = fit_quiet(lm_learner([GradientAccumulation(n_step=1), MicroBatching(3)]), 1)
    tol = floor_tol([floor])
    assert rel_err(weights_of(got), weights_of(ref)) <= tol, tol
    assert abs(got.recorder.values[-1][1] - ref.recorder.values[-1][1]) <= tol*abs(ref.recorder.values[-1][1])
    assert got.gradient_accumulation.steps == len(ref.dls.train)

def lm_fit_floor(lm_learner, cbs=list):
    """(the language model fitted one epoch with the callbacks `cbs()`, float32's rounding on that fit): its weights and
    validation loss against the same fit in float64 (`fit_floor`)"""
    def of(learn): return dict(w=weights_of(learn), v=torch.tensor([learn.recorder.values[-1][1]]))
    def make(dtype):
        learn = lm_learner(cbs())
        return as_float64(learn) if dtype == torch.float64 else learn
    return fit_floor(make, lambda learn: fit_quiet(learn, 1), of)

class ResetEveryBatch(Callback):
    "What users write to train a language model on independent chunks: the hidden state reset before every batch"
    def __init__(self, order): self.order = order
    def before_batch(self):
        if self.training: self.learn.model.reset()

@pytest.mark.parametrize('order', [0, 50])   # before our GradientAccumulation (order 6), and after it
def test_a_reset_before_every_batch_is_respected(lm_learner, order):
    """A user's reset before every batch (fastai calls it for every piece) starts the pieces from the reset state, as
    the unsplit run starts every batch (before: the per-row state overrode a reset made before ours, 7e-4 apart)"""
    ref,floor = lm_fit_floor(lm_learner, lambda: [ResetEveryBatch(order)])
    got = fit_quiet(lm_learner([GradientAccumulation(n_step=1), MicroBatching(3), ResetEveryBatch(order)]), 1)
    w,tol = weights_of,floor_tol([floor])
    carried = fit_quiet(lm_learner(), 1)   # without the resets the weights differ: the test can tell
    assert rel_err(w(got), w(ref)) <= tol < rel_err(w(carried), w(ref)), tol
    assert 'reset' not in lm_learner().model[0].__dict__ and 'reset' not in got.model[0].__dict__   # nothing left behind

def test_a_module_that_resets_what_it_wraps_at_every_forward_carries_no_state():
    """fastai's `SentenceEncoder` (a text classifier's encoder) resets its AWD_LSTM at every forward: nothing in it is
    split by rows (before: micro_bs crashed every text classifier); `carries_batch_state = False` on a module says the
    same of everything inside it"""
    from fastai.text.models.core import SentenceEncoder
    from fastai.text.models.awdlstm import AWD_LSTM
    enc = SentenceEncoder(4, AWD_LSTM(20, 8, 12, 2))
    assert stateful_modules(nn.Sequential(enc, nn.Linear(8, 2))) == ([], [])
    outer = nn.Sequential(CarriesState()); outer.carries_batch_state = False
    assert stateful_modules(outer) == ([], [])
    assert [type(m).__name__ for m in stateful_modules(nn.Sequential(CarriesState()))[1]] == ['CarriesState']

class CarriesState(nn.Module):
    "A model that adds what it saw in the last batch (per row): state between batches, and a `reset()`"
    def __init__(self): super().__init__(); torch.manual_seed(0); self.lin,self.h = nn.Linear(5, 3),None
    def reset(self): self.h = None
    def forward(self, x):
        out = self.lin(x) + (0. if self.h is None or len(self.h) != len(x) else self.h)
        self.h = out.detach()
        return out

class SplitsState(CarriesState):
    "The same, offering its rows: `get_batch_state(bs)` / `set_batch_state(state)`"
    def get_batch_state(self, bs):
        return self.h if self.h is not None and (bs is None or len(self.h) == bs) else torch.zeros(bs, 3)
    def set_batch_state(self, state): self.h = state

def test_unsplittable_state_is_refused_at_fit_start_and_the_protocol_splits():
    ds = make_data(32)
    learn = make_learner(ds, 8, cbs=[GradientAccumulation(n_step=1), MicroBatching(3)], model=CarriesState())
    with pytest.raises(StatefulModelError, match=r"CarriesState.*get_batch_state.*set_batch_state"): fit_quiet(learn, 1)
    assert type(learn.__dict__.get('dl')).__name__ != 'MicroBatches' and 'one_batch' not in learn.__dict__
    ref = fit_quiet(make_learner(ds, 8, model=SplitsState(), dtype=F64), 2)
    got = fit_quiet(make_learner(ds, 8, cbs=[GradientAccumulation(n_step=1), MicroBatching(3)], model=SplitsState(), dtype=F64), 2)
    assert rel_err(weights(got), weights(ref)) <= TOL
    m = CarriesState(); m.carries_batch_state = False   # the user says it holds nothing between batches
    fit_quiet(make_learner(ds, 8, cbs=[GradientAccumulation(n_step=1), MicroBatching(3)], model=m), 1)

# -- the progress total after a halving ---------------------------------------------------------------------------------
class IterSpy(Callback):
    order,run_valid = 61,False   # after the ProgressCallback (60) updated its bar
    def before_fit(self): self.seen = []
    def after_batch(self):
        pbar = getattr(getattr(self.learn, 'progress', None), 'pbar', None)
        self.seen.append((self.iter, self.n_iter, pbar.total if pbar is not None else None))

def test_progress_and_n_iter_follow_the_size_in_force(capsys):
    """Halving mid-epoch (16 -> 8 -> 4) re-counts the epoch's micro-batches: `learn.n_iter` (schedules and
    ShortEpochCallback read it) and the progress bar's total (was 18/4, 450%) follow the size in force"""
    ds = make_data(64)
    spy = IterSpy()
    learn = make_learner(ds, 16, cbs=[GradientAccumulation(n_step=1), MicroBatching('auto'), spy], loss_func=OOMAbove(5), dtype=F64)
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.fit(1)   # with fastai's progress bar
    its = spy.seen
    assert all(i < n and n == t for i,n,t in its), its
    assert its[-1][0] == its[-1][1]-1 == len(its)+2-1   # 2 undone attempts took an iteration each
    assert its[0][1] == 2 + 16   # after the two halvings: the two attempts, then 16 micro-batches of 4

# -- our code warns nothing in a clean fit --------------------------------------------------------------------------------
@pytest.mark.parametrize('ga,bn', [(dict(n_step=2), None), (dict(target_bs=16), 'pool'), (dict(micro_bs=3), 'momentum'),
                                   (dict(micro_bs='auto'), 'pool'), (dict(n_step=2, micro_bs=4), 'freeze'),
                                   (dict(n_step=2), 'renorm'), (dict(micro_bs=4), 'groupnorm')])
def test_no_warning_from_our_code_in_a_clean_fit(ga, bn):
    "Each feature fits, validates and predicts under `warnings.simplefilter('error')` (the `_split` shadowing warning was raised at every micro_bs fit)"
    ds = make_data(32)
    cbs = [*accumulation(**ga)] + ([BatchNormAccumulation(Groups(4) if bn == 'groupnorm' else bn)] if bn else [])
    learn = make_learner(ds, 8, cbs=cbs, model=BNDropNet(p=0.) if bn else None, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        warnings.filterwarnings('ignore', category=DeprecationWarning)
        warnings.filterwarnings('ignore', category=FutureWarning, module='torch')   # torch's own deprecations
        fit_quiet(learn, 2); learn.validate(); learn.get_preds()

# -- a callback before ours cancels the step of a micro-batch inside a window --------------------------------------------
class CancelStepAt(Callback):
    "Ordered before GradientAccumulation: raises CancelStepException in `before_step` at the given micro-batches"
    order = GradientAccumulation.order-1
    def __init__(self, at): self.at,self.k = set(at),-1
    def before_fit(self): self.k = -1
    def before_step(self):
        self.k += 1
        if self.k in self.at: raise CancelStepException()

def test_a_step_cancelled_inside_a_window_keeps_the_window():
    """fastai zeroes the gradients after a cancelled step: at a micro-batch that does not close its window that emptied
    the window's first part, and the step then applied the rest normalised by the whole window (wrong). The window's
    gradient is kept: every step is the big batch's, and the run equals one without the cancels"""
    ds = make_data(48)
    spy = WindowSpy()
    got = make_learner(ds, 4, cbs=[CancelStepAt({0, 1, 5, 9}), GradientAccumulation(n_step=4), spy], dtype=F64)
    fit_quiet(got, 1)
    ref = fit_quiet(make_learner(ds, 4, cbs=[GradientAccumulation(n_step=4)], dtype=F64), 1)
    assert spy.errs and max(spy.errs) <= TOL and got.gradient_accumulation.steps == 3
    assert rel_err(weights(got), weights(ref)) <= TOL
    # a cancelled closing micro-batch drops its window, counted, with the gradients zeroed
    got = make_learner(ds, 4, cbs=[CancelStepAt({3}), GradientAccumulation(n_step=4)], dtype=F64)
    fit_quiet(got, 1)
    assert got.gradient_accumulation.n_step_cancelled == 1 and got.gradient_accumulation.steps == 2

def test_a_learner_with_micro_bs_pickles_and_trains_after():
    "fastai's `export` uses cloudpickle, but plain pickle (and `copy.deepcopy`) must work too: no lambda inside"
    import pickle
    learn = run(make_data(32), 8, [GradientAccumulation(n_step=1), MicroBatching('auto')], loss_func=OOMAbove(5), epochs=1)
    learn.loss_func = F.mse_loss
    again = pickle.loads(pickle.dumps(learn))
    assert again.micro_batching.size == 4 and again.micro_batching in again.cbs
    assert again.micro_batching.snapshot is None or again.micro_batching.snapshot.learn is again
    fit_quiet(again, 1)

def test_language_model_inference_cut_under_auto_keeps_its_rows_state(lm_learner):
    """A validation batch of the AWD_LSTM language model that runs out of memory (above 3 rows, simulated) is cut in
    pieces that each run with their own rows of the carried hidden state: the validation loss equals the uncut run's"""
    def oom(m, inp):
        if not torch.is_grad_enabled() and len(inp[0]) > 3: raise torch.OutOfMemoryError('CUDA out of memory (simulated)')
    ref,got = lm_learner(),lm_learner([GradientAccumulation(n_step=1), MicroBatching('auto')])
    got.model[0].register_forward_pre_hook(oom)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore'); fit_quiet(ref, 1); fit_quiet(got, 1)
    assert got.micro_batching.inference_bs == 2 and got.micro_batching.size == 8
    tol = floor_tol([forward_floor(ref, lambda l, m, x, y: l.loss_func(m(*x)[0], *y),   # (RNNCallback's pick)
                                   state64=lambda m: setattr(m[0], 'hidden', as64(m[0].hidden)))])
    want = ref.recorder.values[-1][1]
    assert abs(got.recorder.values[-1][1] - want) <= tol*abs(want), tol
    with got.no_bar(), ref.no_bar(): v,want = got.validate()[0],ref.validate()[0]
    assert abs(v - want) <= tol*abs(want), (v, want, tol)

# -- dict inputs (Hugging Face's BatchEncoding, blurr's batches), issue 62 ---------------------------------------------------
class DictNet(nn.Module):
    "Takes a dict, as a Hugging Face model takes `input_ids`/`attention_mask`: `a` and `b` features, `mask` multiplies `b`"
    def __init__(self, seed=0):
        super().__init__(); torch.manual_seed(seed)
        self.la,self.lb,self.out = nn.Linear(5, 8),nn.Linear(3, 8),nn.Linear(8, 3)
    def forward(self, x): return self.out(torch.tanh(self.la(x['a']) + self.lb(x['b']*x['mask'][:, None])))

def _dict_learner(bs, cbs, n=24, loss=None):
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import SGD
    g = torch.Generator().manual_seed(3)
    a,b,y = torch.randn(n, 5, generator=g, dtype=F64),torch.randn(n, 3, generator=g, dtype=F64),torch.randint(0, 3, (n,), generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).to(F64)
    items = [({'a': a[i], 'b': b[i], 'mask': mask[i]}, y[i]) for i in range(n)]
    dls = DataLoaders(DataLoader(items, bs=bs), DataLoader(items[:8], bs=bs), device='cpu')
    learn = Learner(dls, DictNet().double(), loss_func=loss or nn.CrossEntropyLoss(), opt_func=SGD, lr=0.1, cbs=[*cbs, Float64Smoothing()])
    learn.recorder.train_metrics = False
    return learn

@pytest.mark.parametrize('micro_bs', [2, 3, 'auto'])
def test_dict_batches_are_cut_key_by_key_and_equal_the_uncut_batch(micro_bs):
    "`micro_bs` on dict inputs (every key cut along the batch): the weights of the uncut loader batches, float64"
    ref = _dict_learner(8, [GradientAccumulation(n_step=1)])
    fit_quiet(ref, 2)
    loss = OOMAbove(4, loss=nn.CrossEntropyLoss()) if micro_bs == 'auto' else None   # ('auto': a device that holds 4)
    cut = _dict_learner(8, [GradientAccumulation(n_step=1), MicroBatching(micro_bs)], loss=loss)
    if micro_bs == 'auto':
        with pytest.warns(UserWarning, match='out of memory with micro-batch 8.*micro_bs is now 4'): fit_quiet(cut, 2)
    else: fit_quiet(cut, 2)
    assert rel_err(weights(cut), weights(ref)) <= TOL
    preds,_ = cut.get_preds(dl=cut.dls.valid)
    assert preds.shape == (8, 3)

def test_the_check_halves_dict_batches():
    "`check_accumulation()` on dict inputs with micro-batches of 4 (it halved them with a slicer that knew no dicts): exact"
    learn = _dict_learner(4, [GradientAccumulation(n_step=2)])
    rep = learn.check_accumulation()
    assert rep.exact, str(rep)
