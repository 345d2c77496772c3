"""Issue 21: losses whose mean is not over the batch, accumulated exactly by default; and `learn.check_accumulation()`,
which says whether accumulation is exact on the user's own Learner and, if not, why (each cause found by an experiment)."""
import copy, random, warnings
import numpy as np, pytest, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.losses import CrossEntropyLossFlat, FocalLossFlat, LabelSmoothingCrossEntropyFlat

from accum_callback import GradientAccumulation, BatchNormAccumulation, Groups, MicroBatching
from accum_callback.testing import OutOfMemoryAbove
from helpers import accumulation, WindowSpy, fit_quiet, floor_tol, make_data, make_learner

F64 = torch.float64
W = torch.tensor([1., 5., 10.], dtype=F64)
W32 = W.float()   # fastai's flattened losses run in float32

def cls_data(n=30, ignore=None, seed=0):
    ds = make_data(n, n_out=3, seed=seed, classify=True)
    x,y = ds.tensors
    if ignore is not None: y = torch.where(torch.rand(n, generator=torch.Generator().manual_seed(seed+7)) < 0.3, ignore, y)
    return TensorDataset(x, y)

LOSSES = {
    'ce_weight':        (lambda: nn.CrossEntropyLoss(weight=W), None),
    'ce_ignore':        (lambda: nn.CrossEntropyLoss(ignore_index=-100), -100),
    'ce_weight_ignore': (lambda: nn.CrossEntropyLoss(weight=W, ignore_index=2, label_smoothing=0.1), 2),
    'nll_weight':       (lambda: (lambda out, y, f=nn.NLLLoss(weight=W): f(F.log_softmax(out, 1), y)), None),
    'flat_weight':      (lambda: CrossEntropyLossFlat(weight=W32), None),
    'flat_ignore':      (lambda: CrossEntropyLossFlat(ignore_index=1), 1),
    'focal_weight':     (lambda: FocalLossFlat(weight=W32), None),   # fastai divides by the count: the batch-size rule holds
    'ce_sum':           (lambda: nn.CrossEntropyLoss(reduction='sum'), None),
    'flat_sum_weight':  (lambda: CrossEntropyLossFlat(weight=W32, reduction='sum'), None),
    'smooth_sum':       (lambda: LabelSmoothingCrossEntropyFlat(reduction='sum'), None),
}

@pytest.mark.parametrize('name', LOSSES)
def test_weighted_ignored_and_summed_losses_are_exact_by_default(name):
    """No `n_items` given: every step's gradient equals the big batch's, windows of 8+8+8+6 items with class weights /
    ignored targets / sums: <= 1e-6 in float64 for torch's losses; fastai's flattened losses compute in float32 whatever
    the input (fastai's `tensor()` casts float64 down), so <= 1e-5 there. Before: CrossEntropyLossFlat(weight) was ~30%
    off the big batch's gradient, a sum loss 0.25x it"""
    make,ignore = LOSSES[name]
    fastai_loss = 'flat' in name or 'focal' in name or 'smooth' in name
    spy = WindowSpy()
    learn = make_learner(cls_data(30, ignore), 4, cbs=[GradientAccumulation(n_step=4), spy], loss_func=make(),
                         dtype=None if fastai_loss else F64)
    fit_quiet(learn, 1)
    assert len(spy.errs) == 2
    if name == 'nll_weight': assert max(spy.errs) > 1e-3   # an unknown loss (a function around NLLLoss) keeps the batch-size rule
    else: assert max(spy.errs) <= (spy.tol if fastai_loss else 1e-6), spy.errs   # float32: its measured floor

# == learn.check_accumulation() ===========================================================================================
from accum_callback import check_accumulation, AccumulationReport
from accum_callback.check.accumulation import CHECK_CAUSES, EXPECTED_CAUSES
from helpers import MLP

class Net(nn.Module):
    """Optional BatchNorm; optional dropout applied in a time-major layout (as `nn.LSTM` without batch_first): its mask
    for a micro-batch is not the big batch's rows (on a CPU, dropout on a batch-first tensor draws the same mask for the
    pieces as for the whole, and is exact)"""
    def __init__(self, bn=False, p=0.):
        super().__init__(); torch.manual_seed(0)
        self.l1,self.bn,self.drop,self.l2 = nn.Linear(5, 16),nn.BatchNorm1d(16) if bn else nn.Identity(),nn.Dropout(p),nn.Linear(16, 3)
    def forward(self, x):
        h = torch.tanh(self.bn(self.l1(x)))
        return self.l2(self.drop(h.t().contiguous()).t())

class Stateful(nn.Module):
    "Carries what it saw in the last batch into the next (and has no way to split it)"
    def __init__(self): super().__init__(); torch.manual_seed(0); self.lin,self.h = nn.Linear(5, 3),None
    def forward(self, x):
        out = self.lin(x) + (0. if self.h is None else self.h.mean(0))
        self.h = out.detach(); return out

def learner(model=None, loss=None, ga=None, bn=None, n=64, bs=4, dtype=None, ds=None, loss_func=None):
    bna = [BatchNormAccumulation(Groups(4) if bn == 'groupnorm' else bn)] if bn else []
    cbs = accumulation(**(ga or dict(n_step=4))) + bna
    ds = ds if ds is not None else cls_data(n, ignore=-100 if loss == 'ignore' else None)
    return make_learner(ds, bs, cbs=cbs, model=model or MLP(n_out=3), loss_func=loss_func or LOSS_FUNCS[loss or 'mean'], dtype=dtype)

def n_counted(learn): return (learn.yb[0] != -100).sum()
LOSS_FUNCS = dict(mean=nn.CrossEntropyLoss(), sum=lambda o,y: F.cross_entropy(o, y, reduction='sum'),
                  ignore=lambda o,y: F.cross_entropy(o, y, ignore_index=-100))   # functions: unknown to `loss_items`

@pytest.mark.parametrize('case,cause', [
    (dict(), None),                                                        # plain: exact, no cause
    (dict(loss='sum'), 'loss_not_mean'),                                   # a sum the rule weighs as a mean
    (dict(loss='ignore'), 'n_items'),                                      # ignore_index, no n_items
    (dict(loss='ignore', ga=dict(n_step=4, n_items=n_counted)), None),     # ... with n_items: exact
    (dict(model=Net(bn=True)), 'batchnorm'),                               # BatchNorm in training
    (dict(model=Net(bn=True), bn='pool'), 'batchnorm'),                    # 'pool' trains on micro-batch statistics
    (dict(model=Net(bn=True), bn='freeze'), None),                         # frozen: exact
    (dict(model=Net(bn=True), bn='groupnorm'), None),                      # converted (on the check's copy): exact
    (dict(model=Net(p=0.5)), 'dropout'),
    (dict(model=Stateful()), 'not_per_sample'),
])
def test_verdict_and_cause(case, cause):
    "Each cause found on a float32 Learner; exactness where it is the claim in float64 (the check's float64 tolerance)"
    learn = learner(**case, dtype=F64 if cause is None else None)
    r = learn.check_accumulation()
    assert isinstance(r, AccumulationReport) and r.n_step == 4 and r.micro_sizes == [4]*4
    if cause is None: assert r.exact and r.dtype == 'float64' and r.rel_error <= r.tol == 1e-10 and r.causes == (), r
    else:
        assert not r.exact and r.rel_error > r.tol and r.causes == (cause,), r
        assert cause in CHECK_CAUSES and r.advice[cause] and r.errors[cause] > r.tol
        said = 'differs only where expected' if cause in EXPECTED_CAUSES else 'NOT exact'
        assert r.level == ('expected' if cause in EXPECTED_CAUSES else 'not exact'), r
        assert cause in str(r) and said in str(r) and '| verdict |' in r._repr_markdown_()

def test_two_causes_at_once():
    r = learner(model=Net(bn=True, p=0.5), loss='sum').check_accumulation()
    assert r.causes == ('loss_not_mean', 'batchnorm', 'dropout'), r

def test_float64_plain_is_exact_to_its_own_tolerance():
    r = learner(dtype=F64).check_accumulation(n_step=3)
    assert r.exact and r.tol == 1e-10 and r.rel_error <= 1e-12 and r.dtype == 'float64'

def test_micro_bs_pieces_are_the_micro_batches():
    "With micro_bs on the Learner the micro-batches are its pieces (loader batches of 8 cut 3, 3, 2)"
    r = learner(ga=dict(micro_bs=3), bs=8).check_accumulation(n_step=5)
    assert r.micro_sizes == [3, 3, 2, 3, 3] and r.exact

def state(learn):
    "Everything the check must leave as it was"
    m = learn.model
    return dict(params=[p.detach().clone() for p in m.parameters()], bufs=[b.clone() for b in m.buffers()],
                grads=[None if p.grad is None else p.grad.clone() for p in m.parameters()],
                modes=[x.training for x in m.modules()], torch=torch.get_rng_state(), py=random.getstate(),
                np=np.random.get_state()[1].copy(), cbs=list(learn.cbs), n_cbs=len(learn.cbs),
                opt=copy.deepcopy(learn.opt.state_dict()) if learn.opt is not None else None, h=getattr(m, 'h', None))

def same(a, b):
    assert all(torch.equal(x, y) for x,y in zip(a['params'], b['params'])) and all(torch.equal(x, y) for x,y in zip(a['bufs'], b['bufs']))
    assert all((x is None and y is None) or torch.equal(x, y) for x,y in zip(a['grads'], b['grads']))
    assert a['modes'] == b['modes'] and torch.equal(a['torch'], b['torch']) and a['py'] == b['py'] and (a['np'] == b['np']).all()
    assert a['cbs'] == b['cbs'] and a['n_cbs'] == b['n_cbs']
    assert (a['opt'] is None) == (b['opt'] is None) and str(a['opt']) == str(b['opt'])
    assert (a['h'] is None and b['h'] is None) or torch.equal(a['h'], b['h'])

@pytest.mark.parametrize('kw', [dict(model=Net(bn=True, p=0.5), bn='pool'), dict(model=Net(bn=True), bn='renorm'),
                                dict(model=Stateful())])
def test_the_check_changes_nothing(kw):
    "Weights, BatchNorm buffers, gradients, optimizer state, RNG states, train/eval mode, callbacks: as before (torch.equal)"
    learn = learner(**kw)
    fit_quiet(learn, 1)   # a trained Learner with an optimizer state, in eval mode after validation
    learn.model.train()   # and in training mode, with a gradient lying around
    learn.loss_func(learn.model(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).backward()
    before = state(learn)
    learn.check_accumulation(); check_accumulation(learn, 2)
    same(before, state(learn))

def test_conversion_happens_on_the_copy():
    "'groupnorm'/'renorm' are checked as training will convert the model, on a copy: the Learner's model keeps its BatchNorm"
    for mode in ('groupnorm', 'renorm'):
        learn = learner(model=Net(bn=True), bn=mode)
        r = learn.check_accumulation()
        assert isinstance(learn.model.bn, nn.BatchNorm1d) and (r.exact if mode == 'groupnorm' else r.causes == ('batchnorm',))

@pytest.mark.parametrize('n_step,match', [(0, '>= 1'), (-2, '>= 1'), (2.5, 'whole number'), (True, 'whole number'),
                                          ('4', 'whole number'), (100, 'gives only 16')])
def test_bad_n_step_names_the_argument(n_step, match):
    learn = learner()
    with pytest.raises(ValueError, match=f'`n_step`.*{match}'): learn.check_accumulation(n_step)

def test_default_n_step_is_the_window():
    assert learner(ga=dict(n_step=3)).check_accumulation().n_step == 3
    learn = make_learner(cls_data(32), 4, loss_func=nn.CrossEntropyLoss())   # no GradientAccumulation: 4
    assert learn.check_accumulation().n_step == 4

def test_mixed_precision_is_checked_in_the_dtype_training_runs_in():
    """fastai's MixedPrecision autocasts on CUDA only (`autocast('cuda')`): a Learner on the CPU trains in float32, and
    the check judges at float32's tolerance (issue 43: it ran autocast on the CPU, judged at bf16's 4e-2, and called a
    real `n_items` error 'unexplained'). The bf16 check under autocast runs in the cuda tier"""
    from fastai.callback.fp16 import MixedPrecision
    learn = learner(); learn.add_cb(MixedPrecision(amp_mode='bf16'))
    r = learn.check_accumulation()
    assert r.dtype == 'float32' and r.tol == 1e-5 and r.exact and r.rel_error <= 1e-6, r
    learn = learner(loss='ignore'); learn.add_cb(MixedPrecision(amp_mode='bf16'))
    r = learn.check_accumulation()
    assert not r.exact and r.causes == ('n_items',), r
    learn = learner(model=Net(bn=True)); learn.add_cb(MixedPrecision(amp_mode='bf16'))
    assert learn.check_accumulation().causes == ('batchnorm',)

def test_float64_model_with_a_float32_loss_is_judged_at_the_loss_precision():
    """fastai's flattened losses return float32 for a float64 model: the gradient carries float32 rounding, so the check
    judges at float32's tolerance (it told the user to supply `n_items`, which cannot fix rounding)"""
    r = learner(dtype=F64, loss_func=CrossEntropyLossFlat()).check_accumulation()
    assert r.dtype == 'float32' and r.tol == 1e-5 and r.exact and r.causes == (), r

def test_float64_counts_are_not_rounded_to_float32():
    """Item counts follow the loss's precision: a float64 model with float64 class weights whose sum float32 rounds
    accumulates to the large batch's gradient at float64's precision (before: 1e-8 off, counts summed in float32)"""
    w = torch.tensor([1., 1/3, 1e-3], dtype=F64)
    spy = WindowSpy()
    learn = make_learner(cls_data(30), 4, cbs=[GradientAccumulation(n_step=4), spy], loss_func=nn.CrossEntropyLoss(weight=w), dtype=F64)
    fit_quiet(learn, 1)
    assert max(spy.errs) <= 1e-13, spy.errs

class SpectralNet(nn.Module):
    "spectral_norm on the first layer: a power iteration updates its buffers at every training forward. No dropout"
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.l1,self.l2 = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 16)),nn.Linear(16, 3)
    def forward(self, x): return self.l2(torch.tanh(self.l1(x)))

@pytest.mark.parametrize('new_api', [True, False])
def test_spectral_norm_is_said_at_fit_start(new_api):
    "Issue 43: what cannot be the large batch is said where cheap: spectral_norm (either of torch's two forms)"
    sn = nn.utils.parametrizations.spectral_norm if new_api else nn.utils.spectral_norm
    model = nn.Sequential(sn(nn.Linear(5, 16)), nn.Tanh(), nn.Linear(16, 3))
    learn = make_learner(cls_data(32), 4, cbs=[GradientAccumulation(n_step=2)], model=model, loss_func=nn.CrossEntropyLoss())
    with pytest.warns(UserWarning, match=r'spectral_norm \(0[.\w]*\) runs its power iteration'): fit_quiet(learn, 1)

def test_spectral_norm_is_named_for_what_it_is():
    "Issue 43: spectral_norm's power iteration (its buffers change at every training forward) was blamed on 'dropout'"
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        r = learner(model=SpectralNet(), dtype=F64).check_accumulation()
    assert not r.exact and r.causes == ('train_state',), r
    r = learner(model=Net(p=0.5)).check_accumulation()
    assert r.causes == ('dropout',), r

class CheckpointedBN(nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.l1,self.bn,self.l2 = nn.Linear(5, 16),nn.BatchNorm1d(16),nn.Linear(16, 3)
    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.l2(torch.tanh(checkpoint(lambda t: self.bn(self.l1(t)), x, use_reentrant=False)))

@pytest.mark.parametrize('bn,named', [(None, True), ('pool', False), ('momentum', False)])
def test_batchnorm_under_checkpointing_is_named(bn, named):
    "Plain BatchNorm inside an activation-checkpointed block counts its statistics twice: the check names it"
    r = learner(model=CheckpointedBN(), bn=bn).check_accumulation()
    assert ('checkpoint' in r.causes) == named, r
    if named: assert 'pytorch#96136' in str(r)

def test_a_big_batch_that_fits_nowhere_is_a_clear_error():
    "The micro-batches fit, one batch of all of them runs out of memory on the device and on the CPU: an error naming n_step"
    class Small(nn.Module):
        def forward(self, x):
            if len(x) > 4: raise torch.OutOfMemoryError('CUDA out of memory (simulated)')
            return x
    model = nn.Sequential(Small(), MLP(n_out=3))
    with pytest.raises(RuntimeError, match=r'16 items of n_step=4.*smaller `n_step`'): learner(model=model).check_accumulation()

# -- models whose output a callback shapes, and models that carry state (fastai's language models) -----------------------
from fastai.callback.core import Callback, CancelBatchException
from helpers import lm_learner_factory

def lm_state(learn):
    "The AWD_LSTM's carried hidden state and the rnn callbacks' attributes (what the check must leave as they were)"
    enc = learn.model[0]
    return ([t.clone() for hc in enc.hidden for t in hc], enc.bs, {k: v for k,v in vars(learn.rnn).items()},
            {k: learn.__dict__.get(k) for k in ('pred', 'loss', 'loss_grad', 'xb', 'yb', 'training')})

@pytest.mark.parametrize('ga,exact', [(dict(micro_bs=3), True), (dict(n_step=2), False), (dict(micro_bs=3, n_step=2), False)])
def test_language_model(ga, exact):
    """fastai's AWD_LSTM with its rnn callbacks (RNNCallback picks the output the loss takes, RNNRegularizer adds AR/TAR;
    WeightDropout keeps computed weights deepcopy refuses): under `micro_bs` the pieces of a loader batch start from their
    own rows of the hidden state, as training runs them, and the check finds them exact (<= 1e-5; the fit itself equals the
    unsplit one, test_micro_bs); accumulating consecutive loader batches carries state from one to the next, which one
    batch of both cannot do: 'not_per_sample', also where the window spans two loader batches cut in pieces. Before, the
    check could not copy the model (WeightDropout) and could not take its output (a tuple)"""
    learn = lm_learner_factory()([*accumulation(**ga)])
    if exact: learn.model.double()   # (tokens in, so the batches need no cast)
    fit_quiet(learn, 1)   # a hidden state carried, the callbacks' attributes set
    before = lm_state(learn)
    r = learn.check_accumulation()
    # a float64 model: what rounds is fastai's float32 loss and AR/TAR (`.float()`), so a few ulps of float32
    if exact: assert r.exact and r.rel_error <= floor_tol([]) and r.micro_sizes == [3, 3, 2], r
    else: assert not r.exact and r.causes == ('not_per_sample',) and r.errors['not_per_sample'] > 1e-2, r
    after = lm_state(learn)
    assert all(torch.equal(a, b) for a,b in zip(before[0], after[0])) and before[1:] == after[1:]

class DictNet(nn.Module):
    "Returns a dict, as Hugging Face models do"
    def __init__(self, **kw): super().__init__(); self.net = Net(**kw)
    def forward(self, x): return {'logits': self.net(x), 'hidden': x}

class Logits(Callback):
    "Picks the logits for the loss (what a fastai wrapper of a dict-returning model does)"
    def after_pred(self): self.learn.pred = self.pred['logits']

STEP = ('pred', 'loss', 'loss_grad', 'xb', 'yb', 'training')

@pytest.mark.parametrize('bn,cause', [(False, None), (True, 'batchnorm')])
def test_a_callback_that_picks_the_output_is_replayed(bn, cause):
    """The loss sees what the Learner's `after_pred` callbacks make of the model's output, in the check as in training
    (before: the loss got the dict and the check failed); the Learner's step attributes stay the fit's own objects"""
    learn = learner(model=DictNet(bn=bn), dtype=F64); learn.add_cb(Logits())   # float64: exactness is the claim
    fit_quiet(learn, 1)
    before = {k: learn.__dict__.get(k) for k in STEP}
    r = learn.check_accumulation()
    assert (r.exact and r.rel_error <= r.tol == 1e-10) if cause is None else r.causes == (cause,), r
    assert all(learn.__dict__.get(k) is v for k,v in before.items())

def test_a_callback_failing_in_the_replay_is_named():
    class Broken(Callback):
        def after_loss(self): raise KeyError('needs the fit')
    learn = learner(); learn.add_cb(Broken())
    before = {k: learn.__dict__.get(k, 'absent') for k in STEP}
    with pytest.raises(RuntimeError, match=r"(?s)replaying `Broken.after_loss`.*failed: .*needs the fit"): learn.check_accumulation()
    assert {k: learn.__dict__.get(k, 'absent') for k in STEP} == before
    class Skips(Callback):
        def after_pred(self): raise CancelBatchException()
    learn = learner(); cb = Skips(); learn.add_cb(cb)
    with pytest.raises(RuntimeError, match=r"`Skips.after_pred`.*raised CancelBatchException.*removed_cbs"): learn.check_accumulation()
    with learn.removed_cbs(cb): assert learn.check_accumulation().exact

@pytest.mark.parametrize('ga,sizes', [(dict(micro_bs='auto'), [4, 4]), (dict(micro_bs='auto', n_step=2), [4]*4),
                                      (dict(micro_bs=3), [3, 3, 2])])
def test_auto_before_any_cut_checks_its_first_halving(ga, sizes):
    """`micro_bs='auto'` that has not cut a batch yet has windows of whole loader batches: checking one against itself
    would say "exact" about nothing. The check runs what the first halving would (pieces of 4 from batches of 8), and
    says so; a fixed micro_bs is checked at its own pieces"""
    r = learner(ga=ga, bs=8).check_accumulation()
    assert r.micro_sizes == sizes and r.exact and (('first halving' in str(r)) == (ga.get('micro_bs') == 'auto')), r
    assert learner(ga=ga, bs=8, model=Net(bn=True)).check_accumulation().causes == ('batchnorm',)

def test_a_window_of_one_says_nothing_is_accumulated():
    r = learner(ga=dict(n_step=1)).check_accumulation()
    assert r.n_step == 1 and r.exact and 'nothing is accumulated' in str(r)
    assert 'note' not in str(learner().check_accumulation())

@pytest.mark.parametrize('bs', [7, 9, 5])
def test_auto_halving_at_an_odd_loader_batch_is_the_one_training_runs(bs):
    """A loader batch of 7 under 'auto' (9, 5): training, out of memory at 7, halves micro_bs to 3 and runs pieces 3+2+2;
    the check, before any cut, checks exactly the pieces training runs (it used `ceil(bs/2)`: 4+3)"""
    r = learner(ga=dict(micro_bs='auto'), bs=bs, n=2*bs).check_accumulation()
    oom = OutOfMemoryAbove(bs-1, nn.CrossEntropyLoss())   # a device with room for one item less than the loader batch
    learn = learner(ga=dict(micro_bs='auto'), bs=bs, n=2*bs, loss_func=oom)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='GradientAccumulation: out of memory'); fit_quiet(learn, 1)
    k = len(r.micro_sizes)   # the check's window: one loader batch, cut as the first halving cuts it
    assert k >= 2 and oom.calls[0] == bs and r.micro_sizes == oom.calls[1:1+k] and sum(r.micro_sizes) == bs and r.exact, (r, oom.calls)

# -- fastai's applications: what the application matrix (tests/test_matrix.py) found ---------------------------------------
def test_check_after_training_a_unet():
    """fastai's U-Net keeps its encoder's activations on hooks (computed tensors deepcopy refuses): the check copies it
    after training too (before: it failed on every trained U-Net)"""
    from apps import ROWS, quiet_fit
    learn = quiet_fit(ROWS['unet'].make([GradientAccumulation(n_step=2), BatchNormAccumulation('freeze')]), 1)
    assert learn.check_accumulation().exact

def test_a_subclass_of_a_fastai_loss_is_counted_as_that_loss():
    "A `CrossEntropyLossFlat` subclass that only sets its arguments is the same loss: its ignored targets are not counted"
    class MyLoss(CrossEntropyLossFlat):
        def __init__(self): super().__init__(ignore_index=1)
    learn = learner(ds=cls_data(ignore=1), loss_func=MyLoss(), dtype=torch.float32)
    assert learn.check_accumulation().exact
    class Halved(CrossEntropyLossFlat):   # its own __call__: another loss, the count is unknown
        def __call__(self, *a, **kw): return super().__call__(*a, **kw)/2
    from accum_callback.core.losses import loss_items
    assert loss_items(Halved(ignore_index=1), (torch.tensor([0, 1, 2]),)) is None
    assert float(loss_items(MyLoss(), (torch.tensor([0, 1, 2]),))) == 2.

def test_fastai_text_classifier_on_ragged_padding_is_named_not_per_sample():
    """fastai's own text classifier is not per-sample on batches padded at the end (texts whose lengths are not multiples
    of `seq_len`, see tests/apps.py): measured here by running the loader batch whole and in its pieces (the check is
    not used for that), the check says NOT exact and names 'not_per_sample' (before: 'unexplained')"""
    from apps import ROWS
    learn = ROWS['text_classifier'].make([GradientAccumulation(n_step=1), MicroBatching(3), BatchNormAccumulation('freeze')], bs=8, ragged=True,
                                         seed=2)   # (seeds 2, 6, 8, 10, 11 show it in the first batch, 0, 1, 3, 4 do not)
    xb,_ = learn.dls.train.new(shuffle=False).one_batch()
    m = learn.model.eval()
    with torch.no_grad(): whole,parts = m(xb)[0],torch.cat([m(xb[s:e])[0] for s,e in [(0, 3), (3, 6), (6, 8)]])
    assert ((parts-whole).norm()/whole.norm()).item() > 1e-3   # fastai's model itself depends on the batch
    r = learn.check_accumulation()
    assert not r.exact and r.causes == ('not_per_sample',), r

class PaddingTerm(Callback):
    "A regulariser that averages over every padded position, as fastai's AR/TAR do: weighed otherwise per micro-batch"
    order = 50
    def after_loss(self):
        if self.training: self.learn.loss_grad = self.learn.loss_grad + 10*self.pred.pow(2).mean()*(self.xb[0] != 0).float().mean()

def test_a_loss_term_over_padding_is_named_regularizer():
    "A callback's term over padded positions is found by the check with the term off (and without it: exact)"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 5, generator=g, dtype=F64); x[8:, 3:] = 0.   # the second loader batch is 'padded'
    ds = TensorDataset(x, torch.randint(0, 3, (16,), generator=g))
    learn = learner(ds=ds, loss_func=nn.CrossEntropyLoss(), bs=8, ga=dict(n_step=2), dtype=F64)
    assert learn.check_accumulation().exact
    learn.add_cb(PaddingTerm())
    r = learn.check_accumulation()
    assert not r.exact and r.causes == ('regularizer',), r

def test_a_gradient_at_rounding_level_is_not_ranked_worst():
    """A bias before a BatchNorm layer has no gradient but rounding (1e-7 of the whole here): its relative error is noise
    (it read 0.94 or 0.96 with the number of threads) and is not ranked; the tensors that do learn are"""
    from accum_callback.check.accumulation import _worst
    big = torch.tensor([1., 0., 1e-8, 0.5, 0.5])     # tensors: w (2 values), b0 (1), b1 (2)
    acc = torch.tensor([1.2, 0., -1e-8, 0.5, 0.55])
    names,sizes = ['w', 'b0', 'b1'],[2, 1, 2]
    got = _worst(names, sizes, acc, big, tol=1e-5)
    assert [n for n,_ in got] == ['w', 'b1'] and abs(got[0][1] - 0.2) < 1e-6   # b0 is 200% off, and rounding noise
    assert [n for n,_ in _worst(names, sizes, acc, big, tol=1e-9)][0] == 'b0'   # at a tolerance that can judge it, it ranks
