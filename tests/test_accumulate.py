"""GradientAccumulation against the one-large-batch run on the same samples (modules `accumulate` and `window_log`: its
logs, `window_sizes`, `n_skipped`, ...)"""
import warnings
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from hypothesis import given, settings, strategies as st, HealthCheck
from fastai.callback.core import Callback, CancelBatchException, CancelFitException
from fastai.callback.training import GradientClip, GradientAccumulation as FastaiGA
from fastai.callback.fp16 import MixedPrecision
import fastai.callback.schedule   # noqa: F401  Learner.fit_one_cycle, lr_find
from fastai.learner import Learner
from fastai.optimizer import Adam, SGD
from torch.amp import GradScaler, autocast

from accum_callback import BatchNormAccumulation, GradientAccumulation, GradientNoiseScale, MicroBatching
from helpers import (accumulation, MLP, WindowSpy, expected_windows, fit_floor, fit_quiet, flat, floor_tol, grads_clean, make_data,
                     make_dls, make_learner, rel_err)

F64 = torch.float64

TOL = 1e-6   # relative error of every step's gradient against the one-large-batch gradient, float64 (float32: `spy.tol`)

# -- construction ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('kw,exc,match', [
    (dict(n_step=2, target_bs=8), ValueError, 'exactly one'),
    (dict(n_step=0), ValueError, 'n_step'),
    (dict(n_step=-3), ValueError, 'n_step'),
    (dict(n_step=2.5), TypeError, 'n_step'),
    (dict(n_step=True), TypeError, 'n_step'),
    (dict(n_step='4'), TypeError, 'n_step'),
    (dict(target_bs=0), ValueError, 'target_bs'),
    (dict(target_bs=1.5), TypeError, 'target_bs'),
    (dict(n_step=2, partial='last'), ValueError, 'partial'),
    (dict(n_step=2, partial=3), ValueError, 'partial'),
    (dict(), TypeError, 'n_step=.*target_bs='),
    (dict(n_acc=8), TypeError, 'n_acc'),
    (dict(micro_bs=2, n_step=2), TypeError, 'micro_bs'),
    (dict(n_step=2, sharded_grads=True), TypeError, 'sharded_grads'),
    (dict(n_step=2, n_items=3), TypeError, 'n_items'),
    (dict(n_step=2, skip_nonfinite='yes'), TypeError, 'skip_nonfinite'),
])
def test_bad_arguments_fail_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match): GradientAccumulation(**kw)

def test_the_window_is_named_or_refused_in_one_line():
    """A positional count is refused naming `n_step=` (fastai's positional count is samples); no window at all, the
    class given as `cbs=GradientAccumulation` (fastai makes it with no arguments) included, is refused naming both
    spellings instead of fastai's default of 32 samples"""
    with pytest.raises(TypeError, match='n_step=') as e: GradientAccumulation(64)
    assert '\n' not in str(e.value)
    with pytest.raises(TypeError, match='n_step=.*target_bs=') as e: make_learner(make_data(8), 4, cbs=GradientAccumulation)
    assert '\n' not in str(e.value)
    with pytest.raises(TypeError, match='n_step=.*target_bs='): make_learner(make_data(8), 4).accumulate()

@pytest.mark.parametrize('kw,exc,match', [(dict(n_acc=0), ValueError, 'target_bs'), (dict(n_acc=2.5), TypeError, 'target_bs'),
                                          (dict(n_acc=8, target_bs=8), TypeError, 'n_acc'), (dict(n_acc=8, n_step=2), ValueError, 'exactly one'),
                                          (dict(micro_bs=0), ValueError, 'size')])
def test_accumulate_checks_fastai_spellings_before_touching_the_learner(kw, exc, match):
    learn = make_learner(make_data(8), 4, cbs=[FastaiGA(8)])
    with pytest.raises(exc, match=match): learn.accumulate(**kw)
    assert [type(c) for c in learn.cbs if isinstance(c, (GradientAccumulation, FastaiGA))] == [FastaiGA]

def test_accumulate_patch_adds_replaces_and_validates_first():
    learn = make_learner(make_data(20), 4, cbs=FastaiGA(8))
    learn.accumulate(3)
    assert isinstance(learn.gradient_accumulation, GradientAccumulation)
    assert sum(isinstance(c, (GradientAccumulation, FastaiGA)) for c in learn.cbs) == 1
    with pytest.raises(ValueError, match='n_step'): learn.accumulate(0)
    assert learn.gradient_accumulation.plan.n_step() == 3   # nothing half-applied

def test_fastai_builtin_alongside_fails_clearly_when_training_and_inference_still_works():
    "The conflict is refused when training starts, naming both classes; validate/get_preds work (and never hang)"
    learn = make_learner(make_data(20), 4, cbs=[GradientAccumulation(n_step=2), FastaiGA(8)])
    with learn.no_bar(), learn.no_logging():
        learn.validate(); learn.get_preds()   # inference sends before_fit too: no raise there (it would keep learn.lock)
    assert not learn.lock.locked()
    with pytest.raises(ValueError, match=r"accum_callback.GradientAccumulation.*fastai.callback.training.GradientAccumulation"):
        fit_quiet(learn, 1)
    assert not learn.lock.locked()
    with learn.no_bar(), learn.no_logging(): assert len(learn.get_preds()[0]) == 8

_NAMES = ('gradient_accumulation', 'micro_batching', 'batch_norm_accumulation', 'gradient_noise_scale')

def _learner_state(learn):
    """What a refused fit must leave as it was: the callbacks, the attributes naming ours (each one of the Learner's
    callbacks, of its class: with twins on the Learner, the first), fastai's methods not wrapped by ours"""
    names = [(type(getattr(learn, n, None)).__name__, getattr(learn, n, None) is None or any(getattr(learn, n) is c for c in learn.cbs)) for n in _NAMES]
    return sorted(type(c).__name__ for c in learn.cbs), names, sorted(k for k in ('one_batch', '_with_events', '_do_epoch', 'dl') if k in learn.__dict__)

def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

# each case: (the callbacks that train, the one that makes the fit refused, the message, a model with BatchNorm)
_REFUSED = {
    'two GradientAccumulation':    (lambda: [GradientAccumulation(n_step=2), MicroBatching(2)], lambda: GradientAccumulation(n_step=3), 'GradientAccumulation` callbacks', False),
    'two MicroBatching':           (lambda: [GradientAccumulation(n_step=2), MicroBatching(2)], lambda: MicroBatching(4), 'MicroBatching` callbacks', False),
    'two BatchNormAccumulation':   (lambda: [GradientAccumulation(n_step=2), MicroBatching(2), BatchNormAccumulation('freeze')], lambda: BatchNormAccumulation('pool'), 'BatchNormAccumulation` callbacks', True),
    'two GradientNoiseScale':      (lambda: [GradientAccumulation(n_step=2), MicroBatching(2), GradientNoiseScale()], lambda: GradientNoiseScale(), 'GradientNoiseScale` callbacks', False),
    'MicroBatching, then another': (lambda: [MicroBatching(4), GradientAccumulation(n_step=2)], lambda: MicroBatching(2), 'MicroBatching` callbacks', False),
    "fastai's beside 'auto'":      (lambda: [GradientAccumulation(n_step=2), MicroBatching('auto')], lambda: FastaiGA(8), 'fastai.callback.training.GradientAccumulation', False),
    'groupnorm on FSDP2':          (lambda: [GradientAccumulation(n_step=2), MicroBatching('auto')], lambda: BatchNormAccumulation('groupnorm'), 'sharded with FSDP2', True),
    'noise with sharded_grads':    (lambda: [GradientAccumulation(n_step=2), MicroBatching(2)], lambda: GradientNoiseScale(), 'reduce-scattered at once', False),   # (the Learner's FSDPOptions)
}

@pytest.mark.parametrize('case', list(_REFUSED))
def test_a_refused_fit_leaves_the_learner_as_it_was(case, monkeypatch):
    """Every refusal of our callbacks is made before any of them sets anything up, whichever refuses: two of the same
    callback (two `GradientAccumulation`s would each skip steps and rescale, two `MicroBatching`s cut twice), fastai's own GradientAccumulation beside ours, and the refusals of
    callbacks that run after `MicroBatching` and `GradientAccumulation` (FSDP2 simulated: only the refusing callback's
    view of the model is patched). Before, `MicroBatching` had cut the loader (and 'auto' wrapped `one_batch`) when a
    later callback refused. After: the message names the class and what to do, the Learner is as it was, inference
    works, and without the refusing callback it trains to the weights of a Learner set up without it (float64, 1e-6)."""
    import accum_callback.batchnorm.callback, accum_callback.noise.scale
    cbs,extra,match,bn = _REFUSED[case]
    cbs,extra = cbs(),extra()
    if case == 'groupnorm on FSDP2': monkeypatch.setattr(accum_callback.batchnorm.callback, 'fsdp_modules', lambda m: [m])
    if case == 'noise with sharded_grads': monkeypatch.setattr(accum_callback.noise.scale, 'is_fsdp', lambda m: True)
    model = (lambda: _bn_model()) if bn else (lambda: None)
    learn = make_learner(make_data(24), 8, cbs=[*cbs, extra], model=model(), dtype=F64)
    if case == 'noise with sharded_grads':
        from accum_callback.core.distributed import FSDPOptions
        learn.fsdp_options = FSDPOptions(sharded_grads=True)   # (as `learn.to_fsdp(sharded_grads=True)` sets it)
    before = _learner_state(learn)
    with pytest.raises(ValueError, match=match) as e: fit_quiet(learn, 1)
    assert _learner_state(learn) == before and not learn.lock.locked()
    assert any(isinstance(m, nn.BatchNorm1d) for m in learn.model.modules()) == bn   # (nothing converted)
    if 'callbacks' in match: assert 'learn.remove_cb(learn.cbs[' in str(e.value)
    with learn.no_bar(), learn.no_logging(): assert len(learn.get_preds()[0]) == 8
    monkeypatch.undo()
    learn.remove_cb(extra)
    ref = make_learner(make_data(24), 8, cbs=_REFUSED[case][0](), model=model(), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # (the noise scale's first windows)
        fit_quiet(learn, 1); fit_quiet(ref, 1)
    assert rel_err(flat(learn.model.parameters()), flat(ref.model.parameters())) <= TOL

def test_a_refused_fit_with_callbacks_of_its_own_leaves_none_of_them():
    """`fit(cbs=[..., MicroBatching(2)])` on a Learner with a `MicroBatching`: refused, and every
    callback given to that fit is gone after it (the refusal used to come from adding the callback, half-way through
    fastai's `added_cbs`, which left the callbacks before it on the Learner). fastai's `remove_cb` of the refused twin
    deletes `learn.micro_batching`, the name both answer to: the next fit start names the Learner's own again"""
    class Other(Callback): pass
    learn = make_learner(make_data(24), 8, cbs=[MicroBatching(4), GradientAccumulation(n_step=2)])
    before,before_cbs = _learner_state(learn),list(learn.cbs)
    with pytest.raises(ValueError, match='MicroBatching` callbacks'): fit_quiet(learn, 1, cbs=[Other(), MicroBatching(2)])
    assert _learner_state(learn)[0] == before[0] and all(c in learn.cbs for c in before_cbs if isinstance(c, (MicroBatching, GradientAccumulation)))
    fit_quiet(learn, 1)
    assert _learner_state(learn)[:2] == before[:2]
    assert learn.micro_batching.size == 4 and learn.gradient_accumulation.window_sizes == [16, 8]   # 2 loader batches a window, then the partial

# -- exactness ---------------------------------------------------------------------------------------------------
def run_spy(n, bs, n_epoch=2, spy=None, ds=None, **kw):
    spy = spy or WindowSpy()
    learn = make_learner(ds or make_data(n), bs, cbs=[*accumulation(**kw), spy], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        fit_quiet(learn, n_epoch)
    return learn, spy

@pytest.mark.parametrize('bs,kw', [(5, dict(target_bs=12)), (6, dict(target_bs=16)), (4, dict(n_step=3)),
                                   (7, dict(n_step=2, partial='carry')), (3, dict(target_bs=10, partial='drop'))])
def test_every_step_is_the_large_batch_gradient(bs, kw):
    learn, spy = run_spy(37, bs, **kw)
    ga = learn.gradient_accumulation
    assert spy.errs and max(spy.errs) <= spy.tol, spy.errs
    assert ga.window_sizes == spy.windows == expected_windows(37, bs, 2, **kw)
    assert ga.steps == len(ga.window_sizes)

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), bs=st.integers(1, 9), n_epoch=st.integers(1, 2), use_target=st.booleans(),
       k=st.integers(1, 5), target=st.integers(1, 25), partial=st.sampled_from(['step', 'drop', 'carry']))
def test_property_windows_and_gradients(n, bs, n_epoch, use_target, k, target, partial):
    kw = dict(target_bs=target) if use_target else dict(n_step=k)
    learn, spy = run_spy(n, bs, n_epoch=n_epoch, partial=partial, **kw)
    exp = expected_windows(n, bs, n_epoch, partial=partial, **kw)
    assert learn.gradient_accumulation.window_sizes == spy.windows == exp
    assert all(e <= TOL for e in spy.errs), spy.errs
    assert grads_clean(learn.model)

def test_fastai_builtin_is_off_where_we_are_exact():
    "The measured gap this project closes: micro-batch 5 with a 12-sample target"
    class Grab(Callback):
        order = 20
        def before_fit(self): self.g = []
        def before_step(self): self.g.append(flat([p.grad.clone() for p in self.model.parameters()]))
    ds = make_data(24)
    ref_learn = make_learner(ds, 15, lr=0.); g = Grab(); ref_learn.add_cb(g); fit_quiet(ref_learn, 1)
    for cb, err in [(FastaiGA(12), lambda e: e > 0.2), (GradientAccumulation(target_bs=12), lambda e: e <= TOL)]:
        learn = make_learner(ds, 5, lr=0.); gg = Grab(); learn.add_cb(cb); learn.add_cb(gg)
        with warnings.catch_warnings(): warnings.simplefilter('ignore'); fit_quiet(learn, 1)
        assert err(rel_err(gg.g[0], g.g[0])), (cb, rel_err(gg.g[0], g.g[0]))

def test_token_weighted_loss_is_exact():
    "A padded token-mean loss: each micro-batch averages over its own non-padded tokens"
    g = torch.Generator().manual_seed(1)
    n, T, V = 30, 7, 5
    x = torch.randn(n, T, 4, generator=g)
    y = torch.randint(0, V, (n, T), generator=g)
    lens = torch.randint(1, T+1, (n,), generator=g)
    y[torch.arange(T)[None] >= lens[:, None]] = -100            # padding
    y[:4, 2:] = -100                                            # very uneven token counts
    ds = torch.utils.data.TensorDataset(x, y)
    tok_loss = lambda p, t: F.cross_entropy(p.reshape(-1, V), t.reshape(-1), ignore_index=-100)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, V))
    spy = WindowSpy()
    learn = Learner(make_dls(ds, 4), model, loss_func=tok_loss, opt_func=SGD, lr=0.1,
                    cbs=[GradientAccumulation(n_step=3, n_items=lambda l: (l.yb[0] != -100).sum()), spy])
    fit_quiet(learn, 2)
    assert max(spy.errs) <= spy.tol, spy.errs
    assert learn.gradient_accumulation.window_items[0] == (y[:12] != -100).sum().item()

def test_window_loss_is_the_large_batch_loss_and_recorder_keeps_true_loss():
    class LossSpy(Callback):
        order = 50
        def before_fit(self): self.pairs = []
        def after_batch(self):
            if self.training: self.pairs.append((self.loss.item(), self.loss_func(self.pred, *self.yb).item()))
    ds = make_data(24); ls = LossSpy()
    learn = make_learner(ds, 4, lr=0., cbs=[GradientAccumulation(n_step=3), ls], dtype=F64)   # float64: which loss, not rounding
    fit_quiet(learn, 1)
    for a, b in ls.pairs: assert a == pytest.approx(b, rel=1e-12)   # not divided by n_step
    m = learn.model
    with torch.no_grad():
        for i, wl in enumerate(learn.gradient_accumulation.window_losses):
            xb, yb = ds.tensors[0][12*i:12*(i+1)].double(), ds.tensors[1][12*i:12*(i+1)].double()
            assert wl == pytest.approx(F.mse_loss(m(xb), yb).item(), rel=1e-12)
    assert learn.gradient_accumulation.window_items == [12., 12.]

# -- schedules ---------------------------------------------------------------------------------------------------
def weights(m): return flat([p.detach() for p in m.parameters()])

@pytest.mark.parametrize('meth', ['fit_one_cycle', 'fit_flat_cos', 'fit_sgdr'])
def test_one_cycle_micro_4x8_equals_batch_32(meth):
    "float32: the weights within float32's rounding on the large batch's fit (against its float64 fit, `floor_tol`)"
    ds = make_data(256, seed=3)
    kw = dict(cycle_len=1) if meth == 'fit_sgdr' else {}
    a,floor = fit_floor(lambda dtype: make_learner(ds, 32, opt_func=Adam, lr=3e-3, dtype=dtype), lambda l: fit_quiet(l, 2, meth=meth, **kw))
    b = make_learner(ds, 4, opt_func=Adam, lr=3e-3, cbs=GradientAccumulation(n_step=8))
    fit_quiet(b, 2, meth=meth, **kw)
    assert b.gradient_accumulation.steps == a.train_iter == (3 if meth == 'fit_sgdr' else 2)*256//32
    err,tol = rel_err(weights(b.model), weights(a.model)),floor_tol([floor])
    assert err <= tol, (err, floor)
    assert rel_err(weights(a.model), weights(MLP(seed=0))) > 1e3*tol   # it trained: the tolerance could tell a wrong step

def test_hypers_come_from_the_first_micro_batch_of_the_window():
    class HyperSpy(Callback):
        order = 30
        def before_fit(self): self.lrs = []
        def before_step(self): self.lrs.append(self.opt.hypers[0]['lr'])
    ds = make_data(64); hs = HyperSpy(); hb = HyperSpy()
    a = make_learner(ds, 16, opt_func=Adam, cbs=hb); fit_quiet(a, 2, meth='fit_one_cycle', lr_max=1e-2)
    b = make_learner(ds, 4, opt_func=Adam, cbs=[GradientAccumulation(n_step=4), hs]); fit_quiet(b, 2, meth='fit_one_cycle', lr_max=1e-2)
    assert hs.lrs == pytest.approx(hb.lrs, rel=1e-12)

class StepHypers(Callback):
    "The hyper-parameters each optimizer step really uses (after `GradientAccumulation` put its window's in force)"
    order,run_valid = GradientAccumulation.order+1,False
    def before_fit(self): self.log = []
    def before_step(self): self.log.append([float(h[k]) for h in self.opt.hypers for k in ('lr', 'mom', 'sqr_mom')])

@pytest.mark.parametrize('n,bs,kw,big', [
    (44, 4, dict(n_step=3), 12),                       # 3 windows of 12 and one of 8 an epoch
    (44, 4, dict(target_bs=12), 12),
    (50, 5, dict(n_step=4), 20),                       # 2 of 20 and one of 10
    (44, 4, dict(n_step=3, micro_bs=2), 12),           # loader batches of 4 cut in 2: windows of 3 loader batches
    (44, 4, dict(n_step=3, partial='drop'), 12),       # the large batch with drop_last=True: 3 steps an epoch
    (44, 4, dict(n_step={0: 3, 1: 2}), {0: 12, 1: 8}), # a window size per epoch: the large batch's per epoch
])
def test_one_cycle_partial_last_window_is_the_large_batch(n, bs, kw, big):
    """Issue 43: a window that does not divide the epoch. fastai's clock advanced per micro-batch, so window j started at
    pct k*j/N_micro instead of the large batch's j/W (up to 7% of lr_max off, weights 6.6e-3 apart). The clock counts
    windows now: every step uses the large batch's learning rate and momenta, and the weights are its weights (float64)"""
    ds = make_data(n, seed=3)
    class BigBs(Callback):   # the large batch whose size changes per epoch, as the window does
        order = -20
        def before_epoch(self):
            if isinstance(big, dict): self.learn.dls.train.bs = big[self.epoch]
    ref_h,acc_h = StepHypers(),StepHypers()
    drop = kw.get('partial') == 'drop'
    a = make_learner(ds, big[0] if isinstance(big, dict) else big, opt_func=Adam, cbs=[ref_h, BigBs()], dtype=torch.float64, drop_last=drop)
    b = make_learner(ds, bs, opt_func=Adam, cbs=[*accumulation(**kw), acc_h], dtype=torch.float64)
    fit_quiet(a, 2, meth='fit_one_cycle', lr_max=0.1); fit_quiet(b, 2, meth='fit_one_cycle', lr_max=0.1)
    assert len(acc_h.log) == len(ref_h.log) == b.gradient_accumulation.steps
    for got,ref in zip(acc_h.log, ref_h.log): assert got == pytest.approx(ref, rel=1e-12, abs=0)
    err = rel_err(weights(b.model), weights(a.model))
    assert err <= 1e-10, err
    assert rel_err(weights(a.model), weights(MLP(seed=0).double())) > 1e-2   # it trained

def test_fine_tune_and_lr_find_work():
    ds = make_data(64)
    learn = make_learner(ds, 4, opt_func=Adam, cbs=GradientAccumulation(n_step=4))
    fit_quiet(learn, 1, meth='fine_tune', freeze_epochs=1)
    assert learn.gradient_accumulation.steps == 64//16
    res = learn.lr_find(num_it=40, show_plot=False)
    assert res.valley > 0 and grads_clean(learn.model)

# -- no gradient survives a fit ----------------------------------------------------------------------------------
class Boom(Callback):
    order = 40
    def __init__(self, exc, at): self.exc,self.at = exc,at
    def after_backward(self):
        if self.train_iter == self.at: raise self.exc

@pytest.mark.parametrize('exc', [CancelFitException(), KeyboardInterrupt(), RuntimeError('boom')])
def test_grads_clean_when_fit_ends_mid_window(exc):
    learn = make_learner(make_data(40), 4, cbs=[GradientAccumulation(n_step=4), Boom(exc, 5)])
    try: fit_quiet(learn, 2)
    except (KeyboardInterrupt, RuntimeError): pass
    assert grads_clean(learn.model)
    assert '_with_events' not in learn.__dict__            # the guard is gone, the Learner still pickles
    learn.remove_cb(Boom)
    spy = WindowSpy(); learn.add_cb(spy); fit_quiet(learn, 1)
    assert max(spy.errs) <= spy.tol and spy.windows == [16, 16, 8]

@pytest.mark.parametrize('partial', ['step', 'drop', 'carry'])
def test_no_leak_into_next_fit(partial):
    "fastai's built-in leaves a partial window's gradient for the next fit; we never do"
    learn = make_learner(make_data(36), 5, cbs=GradientAccumulation(n_step=3, partial=partial))
    fit_quiet(learn, 1)
    assert grads_clean(learn.model)
    for p in learn.model.parameters(): p.grad = torch.full_like(p, 7.)   # even gradients left by hand
    spy = WindowSpy(); learn.add_cb(spy); fit_quiet(learn, 1)
    assert max(spy.errs) <= spy.tol

# -- non-finite losses -------------------------------------------------------------------------------------------
def test_nonfinite_micro_batch_drops_its_window_only():
    ds = make_data(48); ds.tensors[0][21, 2] = float('nan')   # in micro-batch 5 (bs 4) -> window 1 (n_step 4)
    ref = make_data(48)
    learn = make_learner(ds, 4, cbs=GradientAccumulation(n_step=4), dtype=F64)   # float64: which windows, not rounding
    with pytest.warns(UserWarning, match=r'1 window\(s\) dropped'): fit_quiet(learn, 1)
    ga = learn.gradient_accumulation
    assert ga.steps == 2 and ga.n_skipped == 1 and ga.window_sizes == [16, 16]
    assert torch.isfinite(weights(learn.model)).all() and grads_clean(learn.model)
    # the same as training on windows 0 and 2 alone
    keep = torch.cat([torch.arange(0, 16), torch.arange(32, 48)])
    sub = torch.utils.data.TensorDataset(ref.tensors[0][keep], ref.tensors[1][keep])
    other = make_learner(sub, 16, dtype=F64); fit_quiet(other, 1)
    assert rel_err(weights(learn.model), weights(other.model)) <= TOL

def test_skip_nonfinite_false_steps_anyway():
    ds = make_data(16); ds.tensors[0][1, 0] = float('inf')
    learn = make_learner(ds, 4, cbs=GradientAccumulation(n_step=4, skip_nonfinite=False))
    fit_quiet(learn, 1)
    assert not torch.isfinite(weights(learn.model)).all()

# -- other callbacks -------------------------------------------------------------------------------------------
def test_cancelled_batches_do_not_count():
    class Skipper(Callback):
        order = 3
        def before_batch(self):
            if self.training and self.iter in (1, 4): raise CancelBatchException()
    spy = WindowSpy()
    learn = make_learner(make_data(40), 4, cbs=[Skipper(), GradientAccumulation(n_step=3), spy])
    fit_quiet(learn, 1)
    # 10 micro-batches, 2 cancelled: windows of 3, 3 and the last 2 micro-batches
    assert learn.gradient_accumulation.window_micro == [3, 3, 2] and max(spy.errs) <= spy.tol

def test_validation_and_get_preds_untouched():
    ds = make_data(30)
    a = make_learner(ds, 4, dtype=F64); b = make_learner(ds, 4, cbs=GradientAccumulation(n_step=3), dtype=F64)
    pa, ya = a.get_preds(); pb, yb = b.get_preds()
    assert torch.equal(pa, pb)
    fit_quiet(b, 1)
    assert b.recorder.values[-1][1] == pytest.approx(F.mse_loss(*b.get_preds()).item(), rel=1e-12)   # (float64)

def test_gradient_clip_sees_the_whole_window_once():
    ds = make_data(64)
    a = make_learner(ds, 16, cbs=GradientClip(0.05), dtype=F64); fit_quiet(a, 2)   # float64: the clip's place, not rounding
    b = make_learner(ds, 4, cbs=[GradientAccumulation(n_step=4), GradientClip(0.05)], dtype=F64); fit_quiet(b, 2)
    assert rel_err(weights(b.model), weights(a.model)) <= TOL
    c = make_learner(ds, 16, dtype=F64); fit_quiet(c, 2)
    assert rel_err(weights(c.model), weights(a.model)) > 1e-3   # clipping was active

class CPUScalerMP(MixedPrecision):
    "fastai's MixedPrecision with a real GradScaler on the CPU (fp32 compute) to test the scaler's event order"
    def __init__(self, init_scale=2.**10): super().__init__(); self.init_scale = init_scale
    def before_fit(self):
        self.autocast = autocast('cpu', enabled=False)
        self.learn.scaler,self.scales = GradScaler('cpu', init_scale=self.init_scale, growth_interval=1), []
    def after_fit(self): self.kept = list(self.scales); super().after_fit()

def test_grad_scaler_runs_once_per_window_and_stays_exact():
    ds = make_data(64); spy = WindowSpy()
    learn = make_learner(ds, 4, cbs=[GradientAccumulation(n_step=4), CPUScalerMP(), spy])
    fit_quiet(learn, 1)
    mp = learn.cpu_scaler_mp
    assert len(mp.kept) == 4                      # one scaler step (and update) per window
    ref,floor = fit_floor(lambda dtype: make_learner(ds, 16, dtype=dtype), lambda l: fit_quiet(l, 1))
    assert rel_err(weights(learn.model), weights(ref.model)) <= floor_tol([floor]), floor

def test_overflowing_window_is_skipped_whole():
    "A scale so large the gradients overflow: those windows are skipped whole, with one scaler update per window"
    class StepSpy(Callback):
        order = CPUScalerMP.order+5
        def before_fit(self): self.events = []
        def after_cancel_step(self): self.events.append(('skip', self.train_iter//4))
        def after_step(self):
            if not self.events or self.events[-1] != ('skip', self.train_iter//4): self.events.append(('step', self.train_iter//4))
    ds = make_data(96); spy = StepSpy()
    learn = make_learner(ds, 4, cbs=[GradientAccumulation(n_step=4), CPUScalerMP(init_scale=3e38), spy]); fit_quiet(learn, 1)
    ga, mp = learn.gradient_accumulation, learn.cpu_scaler_mp
    stepped = [w for e, w in spy.events if e == 'step']
    assert len(spy.events) == 6 and [w for _, w in spy.events] == list(range(6))   # scaler ran once per window
    assert 0 < ga.steps == len(stepped) == len(mp.kept) < 6 and grads_clean(learn.model)
    keep = torch.cat([torch.arange(16*w, 16*(w+1)) for w in stepped])
    sub = torch.utils.data.TensorDataset(*[t[keep] for t in ds.tensors])
    other,floor = fit_floor(lambda dtype: make_learner(sub, 16, dtype=dtype), lambda l: fit_quiet(l, 1))
    assert rel_err(weights(learn.model), weights(other.model)) <= floor_tol([floor]), floor

class CPUBf16MP(MixedPrecision):
    "fastai's MixedPrecision in bf16 on the CPU (fastai's own autocasts 'cuda' only): no scaler, as fastai does for bf16"
    def before_fit(self):
        self.autocast = autocast('cpu', dtype=torch.bfloat16)
        self.learn.scaler,self.scales = GradScaler('cpu', enabled=False), []

def test_bf16_autocast_on_cpu():
    """bf16 rounds the forward of a micro-batch and of the large batch differently: the weights within bf16's rounding
    on the large batch's fit (against that fit in float64, `floor_tol`), which stays below a fit without accumulation"""
    ds = make_data(64, n_in=8)
    mk = lambda bs, cbs: (lambda dtype: make_learner(ds, bs, cbs=None if dtype else cbs(), opt_func=Adam, lr=1e-3, dtype=dtype))
    a,floor = fit_floor(mk(16, CPUBf16MP), lambda l: fit_quiet(l, 2))
    b = make_learner(ds, 4, cbs=[GradientAccumulation(n_step=4), CPUBf16MP()], opt_func=Adam, lr=1e-3); fit_quiet(b, 2)
    assert b.gradient_accumulation.steps == a.train_iter == 8
    assert torch.isfinite(weights(b.model)).all()
    err,tol = rel_err(weights(b.model), weights(a.model)),floor_tol([floor])
    assert err <= tol, (err, floor)
    c = make_learner(ds, 4, cbs=CPUBf16MP(), opt_func=Adam, lr=1e-3); fit_quiet(c, 2)
    assert rel_err(weights(c.model), weights(a.model)) > tol   # a step per micro-batch is told apart

def test_logs_survive_validate_and_get_preds():
    "fastai sends before_fit/after_fit around validate and get_preds: the last fit's logs and warnings stay put"
    ds = make_data(32); ds.tensors[0][1, 0] = float('nan')
    learn = make_learner(ds, 4, cbs=GradientAccumulation(n_step=2))
    with pytest.warns(UserWarning, match='dropped'): fit_quiet(learn, 1)
    ga = learn.gradient_accumulation; logged = (list(ga.window_sizes), list(ga.window_losses), ga.n_skipped)
    with warnings.catch_warnings():
        warnings.simplefilter('error')                   # no second "dropped" warning
        learn.validate(); learn.get_preds()
    assert (ga.window_sizes, ga.window_losses, ga.n_skipped) == logged == ([8]*3, logged[1], 1)
    with pytest.warns(UserWarning, match='dropped'): fit_quiet(learn, 1, lr=0.)   # a new fit starts new logs
    assert ga.n_skipped == 1 and ga.steps == 3

HOST_SYNCS = ('item', 'tolist', 'cpu', 'numpy', '__bool__', '__float__', '__int__', '__index__')

def test_no_host_synchronisation_in_a_micro_batch_that_does_not_step():
    """Issue 38: on a GPU a `.item()`, `.cpu()`, `bool(tensor)`... waits for every queued kernel. In the micro-batches that
    do not close their window, no code of ours calls one (GradientAccumulation, 'pool', precise statistics' callback,
    GradientNoiseScale with its schedule, Checkpoint): counted on every tensor method that reads a value back to the
    host, from frames in accum_callback/; the window's closing micro-batch may (its one all-reduce of the counts)"""
    import sys, tempfile
    from torch.utils.data import TensorDataset
    from accum_callback import BatchNormAccumulation, GradientNoiseScale, Checkpoint
    calls,where = [0],[]
    saved = {k: getattr(torch.Tensor, k) for k in HOST_SYNCS}
    def counted(k):
        f = saved[k]
        def wrap(self, *a, **kw):
            fr = sys._getframe(1)
            if counting[0] and 'accum_callback' in fr.f_code.co_filename:
                calls[0] += 1; where.append(f"{k} at {fr.f_code.co_filename.split('accum_callback')[-1]}:{fr.f_lineno}")
            return f(self, *a, **kw)
        return wrap
    counting = [False]
    class Count(Callback):
        order = -1000   # first in, last out: the whole micro-batch
        def before_batch(self): counting[0] = not self.learn.gradient_accumulation.window.closes if hasattr(self.learn, 'gradient_accumulation') else False
        def after_batch(self): counting[0] = False
    class Arm(Callback):
        order = GradientAccumulation.order + 1   # the window knows by now whether this micro-batch closes it
        def before_batch(self): counting[0] = not self.learn.gradient_accumulation.window.closes
    noise = GradientNoiseScale()
    torch.manual_seed(0)   # the noise scale's windows (more than 2 micro-batches) from these data, whatever ran before
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    with tempfile.TemporaryDirectory() as d:
        learn = make_learner(TensorDataset(torch.randn(96, 4), torch.randint(0, 3, (96,))), 4, model=model, loss_func=nn.CrossEntropyLoss(),
                             cbs=[GradientAccumulation(target_bs=noise.schedule(warmup=2)), BatchNormAccumulation('pool', precise=16), noise,
                                  Checkpoint(d, every=(3, '1ep')), Count(), Arm()])
        for k in HOST_SYNCS: setattr(torch.Tensor, k, counted(k))
        try: fit_quiet(learn, 2)
        finally:
            for k,f in saved.items(): setattr(torch.Tensor, k, f)
    ga = learn.gradient_accumulation
    assert ga.steps > 4 and sum(ga.window_micro) > 2*ga.steps   # windows of several micro-batches
    assert calls[0] == 0, where[:10]

def test_fsdp_options_are_the_learners():
    """FSDP2's options (`sharded_grads`, `gathered_params`) belong to the Learner's FSDP2 set-up (`learn.to_fsdp(...)`
    / `fsdp_ctx(...)` set `learn.fsdp_options`), read at fit start; `GradientAccumulation` takes none of them. (Their
    effect on the collectives: tests/test_distributed.py::test_fsdp_one_reduce_scatter_round_per_window)"""
    from accum_callback.core.distributed import FSDPOptions
    plain = GradientAccumulation(n_step=2)
    learn = make_learner(make_data(8), 4, cbs=[plain])
    assert plain.sync.options_for(learn) == FSDPOptions()
    learn.fsdp_options = FSDPOptions(gathered_params=True)
    assert plain.sync.options_for(learn) == FSDPOptions(gathered_params=True)
    fit_quiet(learn, 1)
    assert plain.sync.gathered_params and not plain.sync.sharded_grads   # (read at fit start)
    with pytest.raises((TypeError, ValueError), match='sharded_grads'): FSDPOptions(sharded_grads='yes')
