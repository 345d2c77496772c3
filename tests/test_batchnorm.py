"""BatchNormAccumulation, the momentum rule and the BatchNorm conversions, each checked against the large-batch run
(modules `batchnorm`, `bn_stats`: the pooled statistics and their hooks, `norm_layers`, `modes`)"""
import copy, re, warnings
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback, CancelFitException
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.losses import CrossEntropyLossFlat
from fastai.optimizer import SGD
from fastai.learner import Learner
from fastai.vision.learner import vision_learner
from torchvision.models import resnet18

from accum_callback import BatchNormAccumulation, GradientAccumulation, bn_to_batchrenorm, bn_to_groupnorm
from accum_callback import Freeze, Groups, Renorm
from accum_callback.batchnorm.modes import BN_MODES, BN_OPTIONS
from accum_callback.batchnorm.norm_layers import BatchRenorm
from accum_callback.batchnorm.callback import accumulated_momentum
from helpers import accumulation, as_float64, fit_quiet, make_data, make_dls, make_learner, rel_err

# The claims here are exactness (the same statistics, the same normalisation), so they are checked in float64, where
# rounding is far below these tolerances on any CPU; float32's rounding is not what they measure
F64 = torch.float64
STATS_TOL = 1e-6   # relative (norm) error of pooled float64 running statistics against the large-batch run
OUT_TOL = 1e-10    # absolute error between two float64 computations of the same normalisation

pytestmark = pytest.mark.usefixtures('one_thread')

class BNNet(nn.Module):
    """BatchNorm1d on (N,C) and on (N,C,L) input, side by side: a forward normalises with micro-batch statistics, so
    only a BatchNorm whose input no other BatchNorm shaped sees the same input in the micro- and large-batch runs.
    `twice` calls `bn1` a second time per forward."""
    def __init__(self, momentum=0.1, affine=True, track=True, twice=False, seed=0):
        super().__init__(); torch.manual_seed(seed)
        self.l1,self.l1b,self.l2,self.twice = nn.Linear(5, 16),nn.Linear(5, 16),nn.Linear(32, 3),twice
        self.bn1 = nn.BatchNorm1d(16, momentum=momentum, affine=affine, track_running_stats=track)
        self.bn2 = nn.BatchNorm1d(4, momentum=momentum)
    def forward(self, x):
        h = self.l1(x); a = self.bn1(h)
        if self.twice: a = a + self.bn1(h*2+1)
        b = self.bn2(self.l1b(x).view(-1, 4, 4)).flatten(1)
        return self.l2(F.relu(torch.cat([a, b], 1)))

def bn_state(m): return {k:v.clone() for k,v in m.state_dict().items() if 'running' in k or 'num_batches' in k}
def bns(m): "Plain BatchNorm layers (a BatchRenorm is a `_BatchNorm` too)"; return [l for l in m.modules() if isinstance(l, nn.modules.batchnorm._BatchNorm) and not isinstance(l, BatchRenorm)]

class EpochStats(Callback):
    "Running statistics as validation sees them, each epoch"
    order = BatchNormAccumulation.order+1
    def before_fit(self): self.seen = []
    def before_validate(self): self.seen.append(bn_state(self.model))

def fit_pair(ds, micro_bs, ga_kw, big_bs, n_epoch=2, drop_last=False, **model_kw):
    "Micro-batch run with accumulation + 'pool' and the one-large-batch run, SGD lr=0 so the weights never change"
    micro = make_learner(ds, micro_bs, model=BNNet(**model_kw), lr=0., dtype=F64,
                         cbs=[*accumulation(**ga_kw), BatchNormAccumulation('pool'), EpochStats()])
    big = make_learner(ds, big_bs, model=BNNet(**model_kw), lr=0., cbs=EpochStats(), drop_last=drop_last, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore'); micro.fit(n_epoch); big.fit(n_epoch)
    return micro,big

def assert_stats_match(a, b, tol=STATS_TOL):
    assert a.keys() == b.keys()
    for k in a:
        if 'num_batches' in k: assert a[k] == b[k], k
        else: assert rel_err(a[k], b[k]) <= tol, (k, rel_err(a[k], b[k]))

# -- 'pool' -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('momentum', [0.1, None])
@pytest.mark.parametrize('ga_kw,big_bs,drop_last', [
    (dict(n_step=4), 16, False),                   # 30 items: windows 4+4+4+4 and 4+4+4+2 (uneven last micro-batch)
    (dict(target_bs=12), 12, False),               # ceil(12/4)=3 micro-batches: 12, 12, 6
    (dict(n_step=3, partial='drop'), 12, True)])   # windows 12, 12 and a dropped 4+2: the batch `drop_last` leaves out
def test_pool_matches_large_batch(momentum, ga_kw, big_bs, drop_last):
    ds = make_data(30)
    micro,big = fit_pair(ds, 4, ga_kw, big_bs, drop_last=drop_last, momentum=momentum)
    assert_stats_match(bn_state(micro.model), bn_state(big.model))
    for a,b in zip(micro.epoch_stats.seen, big.epoch_stats.seen, strict=True): assert_stats_match(a, b)  # validation too
    assert micro.model.bn1.num_batches_tracked == big.model.bn1.num_batches_tracked == micro.gradient_accumulation.steps   # one update per step
    assert [bn.momentum for bn in bns(micro.model)] == [momentum]*2   # restored

def test_pool_affine_false_and_untracked():
    ds = make_data(30)
    micro,big = fit_pair(ds, 4, dict(n_step=4), 16, affine=False, track=False)
    assert micro.model.bn1.running_mean is None and micro.model.bn1.weight is None
    assert_stats_match(bn_state(micro.model), bn_state(big.model))

def test_pool_skips_nonfinite_window():
    x,y = make_data(32).tensors
    x = x.clone(); x[20] = float('nan')   # second window of 16
    micro = make_learner(TensorDataset(x, y), 4, model=BNNet(), lr=0., dtype=F64,
                         cbs=[GradientAccumulation(n_step=4), BatchNormAccumulation('pool')])
    big = make_learner(TensorDataset(x[:16], y[:16]), 16, model=BNNet(), lr=0., dtype=F64)
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); micro.fit(1); big.fit(1)
    assert micro.gradient_accumulation.n_skipped == 1
    assert_stats_match(bn_state(micro.model), bn_state(big.model))   # one update, from the finite window only

class WindowStats(Callback):
    "Per window, with weights that change between windows: the update equals the one from the concatenated window inputs"
    order = BatchNormAccumulation.order+1
    run_valid = False
    def before_fit(self):
        self.errs,self.n_stepped,self.n_unchanged,self.xs = [],0,0,[]
        bn = self.model.bn1
        self.h = bn.register_forward_hook(lambda m,i,o: self.xs.append(i[0].detach().clone()) if m.training else None)
        self.learn.gradient_accumulation.on_window_close(self.closed)
    def after_fit(self): self.h.remove(); self.learn.gradient_accumulation.remove_window_listener(self.closed)
    def before_batch(self):
        ga,bn = self.learn.gradient_accumulation,self.model.bn1
        if ga.window_start: self.start,self.xs = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()),[]
    def closed(self, stepped):
        bn = self.model.bn1
        if not stepped:
            assert torch.equal(bn.running_mean, self.start[0]) and bn.num_batches_tracked == self.start[2]
            self.n_unchanged += 1; return
        x,m = torch.cat(self.xs).double(),0.1   # the layer's own momentum (it reads 1.0 during a 'pool' fit)
        mean,var = x.mean(0),x.var(0)
        self.errs += [rel_err(bn.running_mean.double(), (1-m)*self.start[0].double() + m*mean),
                      rel_err(bn.running_var.double(), (1-m)*self.start[1].double() + m*var)]
        assert bn.num_batches_tracked == self.start[2]+1
        self.n_stepped += 1

@pytest.mark.parametrize('partial,n_stepped,n_unchanged', [('drop', 4, 2), ('carry', 5, 1)])
def test_pool_per_window_with_training_and_shared_layer(partial, n_stepped, n_unchanged):
    "lr > 0, a BatchNorm called twice per forward (both calls pooled), windows dropped or carried across epochs"
    ds = make_data(30)   # 8 micro-batches an epoch: 'drop' gives windows 3, 3 and a dropped 2 each epoch;
    learn = make_learner(ds, 4, model=BNNet(twice=True), lr=0.1, dtype=F64,   # 'carry': 3 x 5, the 1 left at the end dropped
                         cbs=[GradientAccumulation(n_step=3, partial=partial), BatchNormAccumulation('pool'), WindowStats()])
    learn.fit(2)
    spy = learn.window_stats
    assert (spy.n_stepped, spy.n_unchanged) == (n_stepped, n_unchanged)
    assert max(spy.errs) < STATS_TOL
    assert learn.model.bn1.momentum == 0.1 and not learn.model.bn1._forward_hooks and not learn.model.bn1._forward_pre_hooks

# -- cleanup and errors -----------------------------------------------------------------------------------------------
class Stop(Callback):
    def __init__(self, exc, at=3): self.exc,self.at = exc,at
    def after_batch(self):
        if self.training and self.iter == self.at: raise self.exc

@pytest.mark.parametrize('mode', ['pool', 'momentum', 'freeze'])
@pytest.mark.parametrize('exc', [CancelFitException(), RuntimeError('boom')])
def test_restored_after_cancel_and_error(mode, exc):
    model = BNNet(momentum=0.2)
    learn = make_learner(make_data(32), 4, model=model, lr=0.1,
                         cbs=[GradientAccumulation(n_step=4), BatchNormAccumulation(mode), Stop(exc)])
    if isinstance(exc, CancelFitException): learn.fit(1)
    else:
        with pytest.raises(RuntimeError, match='boom'): learn.fit(1)
    for bn in bns(model):
        assert bn.momentum == 0.2 and not bn._forward_hooks and not bn._forward_pre_hooks
        assert bn.training == model.l1.training
    assert '_with_events' not in learn.__dict__
    learn.remove_cb(learn.stop); learn.fit(1)   # a clean fit afterwards
    assert all(bn.momentum == 0.2 for bn in bns(model))

@pytest.mark.parametrize('mode', ['pool', 'momentum'])
def test_missing_gradient_accumulation(mode):
    learn = make_learner(make_data(16), 4, model=BNNet(), cbs=BatchNormAccumulation(mode))
    with pytest.raises(ValueError, match='GradientAccumulation'): learn.fit(1)
    assert learn.model.bn1.momentum == 0.1 and not learn.model.bn1._forward_hooks

@pytest.mark.parametrize('mode', ['freeze', 'groupnorm', 'renorm'])
def test_modes_without_gradient_accumulation(mode):
    learn = make_learner(make_data(16), 4, model=BNNet(), cbs=BatchNormAccumulation(mode))
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.fit(1)

def test_bad_arguments():
    with pytest.raises(ValueError, match=re.escape(f"`mode` must be one of {BN_MODES}")):
        BatchNormAccumulation('ghost')
    with pytest.raises(ValueError, match='num_groups'): BatchNormAccumulation(Groups(num_groups=0))
    with pytest.raises(ValueError, match='r_max'): BatchNormAccumulation(Renorm(r_max=0.5))
    with pytest.raises(ValueError, match='d_max'): bn_to_batchrenorm(nn.BatchNorm2d(3), d_max=-1)
    with pytest.raises(ValueError, match='train_affine'): BatchNormAccumulation(Freeze(train_affine=1))
    with pytest.raises(ValueError, match='`k`'): accumulated_momentum(0.1, 0)

# -- the modes' options objects ---------------------------------------------------------------------------------------
@pytest.mark.parametrize('make,said', [
    (lambda: Freeze(train_affine=1), "`Freeze.train_affine` must be True or False, got 1: True trains"),
    (lambda: Groups(num_groups=0), "`Groups.num_groups` must be a whole number >= 1, got 0: the most groups"),
    (lambda: Groups(num_groups=4.), "`Groups.num_groups` must be a whole number >= 1, got 4.0: "),
    (lambda: Groups(num_groups=True), "`Groups.num_groups` must be a whole number >= 1, got True: "),
    (lambda: Renorm(r_max=0.5), "`Renorm.r_max` must be a number >= 1, got 0.5: the largest std correction; 1 turns"),
    (lambda: Renorm(r_max=float('nan')), "`Renorm.r_max` must be a number >= 1, got nan: "),
    (lambda: Renorm(d_max=-1), "`Renorm.d_max` must be a number >= 0, got -1: the largest mean correction"),
    (lambda: Renorm(d_max='5'), "`Renorm.d_max` must be a number >= 0, got '5': "),
    (lambda: Renorm(warmup=-1), "`Renorm.warmup` must be a whole number >= 0, got -1: training forwards as plain"),
    (lambda: Renorm(ramp=2.5), "`Renorm.ramp` must be a whole number >= 0, got 2.5: training forwards over which"),
], ids=['train_affine', 'num_groups', 'num_groups-float', 'num_groups-bool', 'r_max', 'r_max-nan', 'd_max', 'd_max-str',
        'warmup', 'ramp'])
def test_mode_options_refuse_a_bad_field_in_one_line(make, said):
    with pytest.raises(ValueError) as e: make()
    assert str(e.value).startswith(said) and '\n' not in str(e.value)

def test_mode_options_are_frozen_values_named_as_their_mode():
    assert {c.name: c for c in (Freeze, Groups, Renorm)} == BN_OPTIONS and all(c in BN_MODES for c in BN_OPTIONS)
    assert Renorm() == Renorm(r_max=3., d_max=5., warmup=0, ramp=5000) != Renorm(ramp=10)
    assert hash(Groups(4)) == hash(Groups(4))
    assert (Freeze().train_affine, Groups().num_groups, Renorm().ramp) == (True, 32, 5000)   # 0.2's keyword defaults
    with pytest.raises(AttributeError): Renorm().r_max = 2.   # frozen: a callback's options cannot change under it
    assert repr(Freeze(train_affine=False)) == 'Freeze(train_affine=False)' and 'name' not in repr(Renorm())

GIVEN = {'freeze': dict(train_affine=False), 'groupnorm': dict(num_groups=4), 'renorm': dict(ramp=9)}

@pytest.mark.parametrize('mode', BN_MODES)
def test_a_mode_by_name_is_its_default_options(mode):
    "`BatchNormAccumulation('renorm')` is `BatchNormAccumulation(Renorm())`: the same name and equal options"
    by_name = BatchNormAccumulation(mode)
    assert by_name.mode == mode
    if mode not in BN_OPTIONS: assert by_name.options is None; return
    by_object = BatchNormAccumulation(BN_OPTIONS[mode]())
    assert (by_object.mode, by_object.options) == (by_name.mode, by_name.options) == (mode, BN_OPTIONS[mode]())
    given = BN_OPTIONS[mode](**GIVEN[mode])
    assert BatchNormAccumulation(given).options is given and BatchNormAccumulation(given).mode == mode

def test_a_conversion_takes_its_options_object():
    "`convert` (what fit, `check_accumulation` and `to_fsdp` use) builds the layers from the options given with the mode"
    gn = BatchNormAccumulation(Groups(num_groups=4)).convert(nn.Sequential(nn.BatchNorm1d(8)))[0]
    assert isinstance(gn, nn.GroupNorm) and gn.num_groups == 4
    bna = BatchNormAccumulation(Renorm(r_max=2., d_max=1., warmup=3, ramp=7))
    br = bna.convert(nn.Sequential(nn.BatchNorm1d(8)))[0]
    assert (type(br).__name__, br.r_max, br.d_max, br.warmup, br.ramp) == ('BatchRenorm1d', 2., 1., 3, 7)
    assert BatchNormAccumulation(Freeze(train_affine=False)).convert(m := nn.BatchNorm1d(8)) is m

def test_a_mode_is_a_name_or_an_options_object():
    with pytest.raises(ValueError, match=r"^`mode`: give the options object, `Renorm\(\)`, not its class$"):
        BatchNormAccumulation(Renorm)
    with pytest.raises(ValueError, match=r"^`mode` must be one of .* or a mode's options \(Freeze"):
        BatchNormAccumulation(nn.GroupNorm(2, 4))
    with pytest.raises(ValueError, match=r"`precise`: 'freeze' keeps"): BatchNormAccumulation(Freeze(), precise=8)

@pytest.mark.parametrize('kw,new,names', [
    (dict(r_max=2), 'mode=Renorm(r_max=2)', 'Renorm'),
    (dict(d_max=1.), 'mode=Renorm(d_max=1.0)', 'Renorm'),
    (dict(warmup=2, ramp=10), 'mode=Renorm(warmup=2, ramp=10)', 'Renorm'),
    (dict(num_groups=4), 'mode=Groups(num_groups=4)', 'Groups'),
    (dict(train_affine=False), 'mode=Freeze(train_affine=False)', 'Freeze'),
    (dict(r_max=2, num_groups=4), 'mode=Renorm(r_max=2) or mode=Groups(num_groups=4)', 'Renorm, Groups'),
], ids=['r_max', 'd_max', 'warmup-ramp', 'num_groups', 'train_affine', 'two-modes'])
def test_0_2_option_keywords_are_refused_with_their_0_3_spelling(kw, new, names):
    with pytest.raises(TypeError) as e: BatchNormAccumulation('renorm', **kw)
    old = ', '.join(f'{k}={v!r}' for k,v in kw.items())
    assert str(e.value) == f"`{old}` is `{new}` since 0.3 (`from accum_callback import {names}`)"

def test_an_unknown_keyword_is_pythons_error():
    with pytest.raises(TypeError, match=r"^BatchNormAccumulation.__init__\(\) got an unexpected keyword argument 'momentum'$"):
        BatchNormAccumulation('pool', momentum=0.1)

@pytest.mark.parametrize('mode', BN_MODES)
def test_no_batchnorm_warns(mode):
    learn = make_learner(make_data(16), 4, cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation(mode)])
    before = copy.deepcopy(learn.model)
    with pytest.warns(UserWarning, match='no BatchNorm'): learn.fit(1, lr=0.)
    assert str(before) == str(learn.model)

# -- 'momentum' and 'freeze' ------------------------------------------------------------------------------------------
def test_accumulated_momentum():
    for m in (0.01, 0.1, 0.5, 1.):
        for k in (1, 2, 7): assert abs((1-accumulated_momentum(m, k))**k - (1-m)) < 1e-12
    assert accumulated_momentum(None, 4) is None and accumulated_momentum(0.1, 1) == pytest.approx(0.1, abs=1e-15)

class SeeMomentum(Callback):
    order = BatchNormAccumulation.order+1
    def before_fit(self): self.seen = set()
    def before_batch(self):
        if self.training: self.seen.add(tuple(bn.momentum for bn in bns(self.model)))

@pytest.mark.parametrize('ga_kw,k', [(dict(n_step=4), 4), (dict(target_bs=10), 3)])
def test_momentum_mode(ga_kw, k):
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 3))
    learn = make_learner(make_data(32), 4, model=model, cbs=[*accumulation(**ga_kw), BatchNormAccumulation('momentum'), SeeMomentum()])
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.fit(1)
    assert learn.see_momentum.seen == {(accumulated_momentum(0.1, k), None)}
    assert (model[1].momentum, model[2].momentum) == (0.1, None)

class SeeModes(Callback):
    order = BatchNormAccumulation.order+1
    def before_fit(self): self.seen = set()
    def before_batch(self):
        if self.training: self.seen.add((self.model.l1.training, *(bn.training for bn in bns(self.model))))

@pytest.mark.parametrize('train_affine', [True, False])
def test_freeze_mode(train_affine):
    model = BNNet()
    model.train(); model(torch.randn(64, 5))   # statistics to freeze
    stats,affine = bn_state(model),[p.clone() for bn in bns(model) for p in bn.parameters()]
    learn = make_learner(make_data(32), 4, model=model, lr=0.1,
                         cbs=[BatchNormAccumulation(Freeze(train_affine=train_affine)), SeeModes()])
    learn.fit(1)
    assert learn.see_modes.seen == {(True, False, False)}
    assert_stats_match(bn_state(model), stats, tol=0.)
    changed = [not torch.equal(p, q) for p,q in zip([p for bn in bns(model) for p in bn.parameters()], affine)]
    assert all(changed) if train_affine else not any(changed)
    assert all(p.requires_grad for p in model.parameters())
    assert all(bn.training == model.l1.training for bn in bns(model))   # the loop leaves the model in eval

# -- BatchRenorm and the conversions ----------------------------------------------------------------------------------
def trained_resnet(seed, n=3):
    torch.manual_seed(seed)
    m = resnet18(weights=None, num_classes=5).train()
    with torch.no_grad():
        for _ in range(n): m(torch.randn(4, 3, 32, 32)*2+1)   # running statistics away from their initial values
    return m.eval()

@pytest.mark.parametrize('seed', [0, 1, 2])
def test_renorm_conversion_keeps_eval_output_and_state_dict(seed):
    m = trained_resnet(seed); x = torch.randn(4, 3, 32, 32)
    sd,y,ps = copy.deepcopy(m.state_dict()),m(x),list(m.parameters())
    m2 = bn_to_batchrenorm(m, r_max=2., d_max=1., ramp=10)
    assert m2 is m and isinstance(m.bn1, BatchRenorm) and not bns(m)
    assert torch.equal(m(x), y)                                  # bit-identical eval output
    assert all(p is q for p,q in zip(m.parameters(), ps, strict=True))
    assert m.state_dict().keys() == sd.keys()
    m.load_state_dict(sd)                                        # a BatchNorm state dict loads strictly
    fresh = resnet18(weights=None, num_classes=5).eval(); fresh.load_state_dict(m.state_dict())   # and back
    assert torch.equal(fresh(x), y)
    assert repr(m.bn1) == ('BatchRenorm2d(64, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True, '
                           'r_max=2.0, d_max=1.0, warmup=0, ramp=10)')

@pytest.mark.parametrize('shape', [(8, 6), (8, 6, 5), (4, 6, 3, 3), (2, 6, 2, 2, 2)])
def test_batchrenorm_is_batchnorm_before_ramp(shape):
    "With r_max=1, d_max=0 (warmup) it is BatchNorm in training: output, gradient and running statistics"
    bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)](6, dtype=F64)
    with torch.no_grad(): bn.weight.uniform_(0.5, 2); bn.bias.uniform_(-1, 1)
    br = bn_to_batchrenorm(copy.deepcopy(bn), warmup=2)
    for _ in range(2):
        x = (torch.randn(shape, dtype=F64)*3+2).requires_grad_()
        y1 = bn(x); g1, = torch.autograd.grad(y1.square().sum(), x)
        y2 = br(x); g2, = torch.autograd.grad(y2.square().sum(), x)
        assert (y1-y2).abs().max() < OUT_TOL and (g1-g2).abs().max() < OUT_TOL*10   # (the gradient is ~10x the output)
    for k,v in bn.state_dict().items(): assert torch.allclose(v.double(), br.state_dict()[k].double(), rtol=1e-12, atol=1e-15), k
    assert br.limits() == (1., 0.)

def test_batchrenorm_corrects_towards_running_stats():
    br = BatchRenorm(3, r_max=3., d_max=5., ramp=4).double()
    with torch.no_grad(): br.running_mean.fill_(1.); br.running_var.fill_(4.)
    br.renorm_steps = 4; assert br.limits() == (3., 5.)
    x = torch.randn(64, 3, dtype=F64)*0.5
    mu,var = x.mean(0),x.var(0, unbiased=False)
    rstd = (torch.tensor(4., dtype=F64)+br.eps).sqrt(); std = (var+br.eps).sqrt()
    r,d = (std/rstd).clamp(1/3, 3),((mu-1)/rstd).clamp(-5, 5)
    assert (br(x) - ((x-mu)/std*r + d)).abs().max() < OUT_TOL
    br.eval(); assert (br(x) - (x-br.running_mean)/(br.running_var+br.eps).sqrt()).abs().max() < OUT_TOL
    with pytest.raises(ValueError, match='got 6-D'): br.train()(torch.randn(1, 3, 2, 2, 2, 2))
    with pytest.raises(ValueError, match='more than 1 value'): br(torch.randn(1, 3))

def test_renorm_untracked_and_affine_false():
    m = nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.BatchNorm1d(4, track_running_stats=False)).double()
    ref = copy.deepcopy(m); x = torch.randn(8, 4, dtype=F64)*2+1
    bn_to_batchrenorm(m)
    assert m[0].weight is None and m[1].running_mean is None
    assert (m(x)-ref(x)).abs().max() < OUT_TOL
    m.eval(); ref.eval(); assert (m(x)-ref(x)).abs().max() < OUT_TOL   # after one update each (lerp vs BatchNorm's formula)

def image_learner(bs=4, n=16, cbs=None):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 4, (n,), generator=g))
    dls = DataLoaders(DataLoader(ds, bs=bs), DataLoader(ds, bs=bs), device='cpu')
    torch.manual_seed(0)
    return vision_learner(dls, resnet18, pretrained=False, n_out=4, loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=1e-2, cbs=cbs)

def test_groupnorm_conversion_vision_learner():
    learn = image_learner()
    ids,flags = [id(p) for p in learn.model.parameters()],[p.requires_grad for p in learn.model.parameters()]
    learn.model.train()(torch.randn(4, 3, 32, 32))
    with pytest.warns(UserWarning, match='running statistics') as rec: m = bn_to_groupnorm(learn.model)
    assert len(rec) == 1 and m is learn.model and not bns(m)
    assert [id(p) for p in m.parameters()] == ids and [p.requires_grad for p in m.parameters()] == flags
    gns = [l for l in m.modules() if isinstance(l, nn.GroupNorm)]
    assert len(gns) == 22 and {g.num_groups for g in gns} == {32} and all(g.training for g in gns)
    head_gn = m[1][2]
    x = torch.randn(4, 1024, dtype=F64)   # a BatchNorm1d's (N,C) input: normalised over 32 channels per group and sample
    xg = x.view(4, 32, 32); ref = ((xg-xg.mean(-1, keepdim=True))/(xg.var(-1, unbiased=False, keepdim=True)+1e-5).sqrt()).view(4, 1024)
    gn64 = copy.deepcopy(head_gn).double()   # (a float64 copy: the learner trains below)
    assert (gn64(x) - (ref*gn64.weight + gn64.bias)).abs().max() < OUT_TOL
    learn.freeze()   # the optimizer is built now, on the converted model
    body = [p for l in m[0].modules() if isinstance(l, nn.Conv2d) for p in l.parameters()]
    assert not any(p.requires_grad for p in body) and all(p.requires_grad for p in m[1].parameters())
    learn.fit(1); learn.unfreeze(); assert all(p.requires_grad for p in m.parameters())

def test_groupnorm_mode_keeps_optimizer_and_freeze():
    learn = image_learner(cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('groupnorm')])
    learn.freeze()   # optimizer built on the BatchNorm model: `train_bn` keeps BatchNorm parameters trainable
    opt_ids = [id(p) for p,*_ in learn.opt.all_params()]
    bn_ps = [p for bn in bns(learn.model) for p in bn.parameters()]
    before = [p.clone() for p in bn_ps]
    learn.fit(1)
    assert not bns(learn.model) and [id(p) for p,*_ in learn.opt.all_params()] == opt_ids
    assert all(p.requires_grad for p in bn_ps) and all(not torch.equal(p, q) for p,q in zip(bn_ps, before))
    assert not any(p.requires_grad for l in learn.model[0].modules() if isinstance(l, nn.Conv2d) for p in l.parameters())
    learn.unfreeze(); learn.fit(1)

def test_renorm_mode_on_resnet():
    learn = image_learner(cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation(Renorm(ramp=2))])
    learn.model.eval(); x = torch.randn(2, 3, 32, 32); y = learn.model(x)
    learn.fit(1)
    assert not bns(learn.model) and sum(isinstance(l, BatchRenorm) for l in learn.model.modules()) == 22
    assert learn.model[0][1].renorm_steps == 4 and learn.model[0][1].limits() == (3., 5.)
    assert not torch.equal(learn.model.eval()(x), y)   # it trained

def test_conversion_edge_cases():
    assert isinstance(bn_to_groupnorm(nn.BatchNorm2d(6), num_groups=4), nn.GroupNorm)   # the root itself: a new module
    assert bn_to_groupnorm(nn.BatchNorm2d(6), num_groups=4).num_groups == 3              # largest divisor <= 4
    shared = nn.BatchNorm2d(8); m = nn.Sequential(shared, nn.ReLU(), shared)
    bn_to_groupnorm(m); assert m[0] is m[2]                                           # sharing kept
    sync = nn.Sequential(nn.SyncBatchNorm(8)); bn_to_batchrenorm(sync); assert isinstance(sync[0], BatchRenorm)
    with pytest.warns(UserWarning, match='one channel per group'): bn_to_groupnorm(nn.Sequential(nn.BatchNorm1d(16)))
    with warnings.catch_warnings():
        warnings.simplefilter('error'); g = bn_to_groupnorm(nn.Sequential(nn.BatchNorm2d(8, affine=False).eval()))[0]
    assert g.weight is None and not g.training   # fresh statistics: no warning

def test_pool_error_inside_batchnorm_forward():
    "A BatchNorm that raises between the hooks (one value per channel) leaves its own buffers in place"
    model = BNNet(); rm,rv = model.bn1.running_mean,model.bn1.running_var
    learn = make_learner(make_data(33), 4, model=model, cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool')])
    with pytest.raises(ValueError, match='gets 1 value per channel'): learn.fit(1)   # the last micro-batch holds one item
    assert model.bn1.running_mean is rm and model.bn1.running_var is rv and model.bn1.momentum == 0.1
    assert torch.isfinite(rm).all() and not model.bn1._forward_hooks

@pytest.mark.parametrize('shape', [(8, 6), (4, 6, 5), (3, 6, 4, 4)])
def test_batchrenorm_gradients_follow_the_paper(shape):
    "Output and gradients equal the explicit formula with r and d held constant (Ioffe 2017), r and d clipped"
    torch.manual_seed(0)
    m = BatchRenorm(6, r_max=1.5, d_max=0.5).double(); m.train()
    with torch.no_grad(): m.running_mean.uniform_(-1, 1); m.running_var.uniform_(0.2, 3); m.weight.uniform_(0.5, 2); m.bias.uniform_(-1, 1)
    m.renorm_steps = 10**6                                   # past the ramp: full r_max, d_max
    rm, rv = m.running_mean.clone(), m.running_var.clone()
    x = (torch.randn(*shape, dtype=F64)*2 + 0.7).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y = m(x); g = torch.randn_like(y); y.backward(g)
    dims = [0, *range(2, x.dim())]; view = (1, -1) + (1,)*(x.dim()-2)
    var, mean = torch.var_mean(x2, dim=dims, correction=0); std = (var + m.eps).sqrt(); rstd = (rv + m.eps).sqrt()
    r = (std/rstd).detach().clamp(1/1.5, 1.5); d = ((mean - rm)/rstd).detach().clamp(-0.5, 0.5)
    w, b = m.weight.detach().clone().requires_grad_(), m.bias.detach().clone().requires_grad_()
    ref = (((x2 - mean.view(view))/std.view(view))*r.view(view) + d.view(view))*w.view(view) + b.view(view)
    ref.backward(g)
    assert (r != 1).any() and (d.abs() == 0.5).any()         # the correction and its clipping are active
    close = lambda a, b: torch.allclose(a, b, rtol=1e-10, atol=1e-10)   # float64: two computations of one formula
    assert close(y, ref) and close(x.grad, x2.grad) and close(m.weight.grad, w.grad) and close(m.bias.grad, b.grad)
    n = x.numel()//6   # running statistics: BatchNorm's update, unbiased variance, momentum 0.1
    assert close(m.running_mean, rm.lerp(mean.detach(), 0.1)) and close(m.running_var, rv.lerp(var.detach()*n/(n-1), 0.1))

# -- timm: norm-act layers (BatchNormAct2d = BatchNorm2d + dropout + activation) ---------------------------------------
def _timm_bn_act(c=8):
    layers = pytest.importorskip('timm.layers')
    torch.manual_seed(0)
    bn = layers.BatchNormAct2d(c, act_layer=nn.SiLU)
    with torch.no_grad(): bn.weight.uniform_(0.5, 2); bn.bias.uniform_(-1, 1); bn.running_mean.uniform_(-1, 1); bn.running_var.uniform_(0.5, 2)
    return bn

def test_timm_norm_act_keeps_its_activation_in_conversions():
    x = torch.randn(4, 8, 5, 5)
    with pytest.warns(UserWarning, match='running statistics .* discarded'): gn = bn_to_groupnorm(_timm_bn_act(), num_groups=4)
    assert isinstance(gn.act, nn.SiLU) and gn.weight is not None
    gn64,x64 = copy.deepcopy(gn).double(),x.double()   # float64: the same function, not float32's rounding of it
    assert torch.allclose(gn64(x64), F.silu(F.group_norm(x64, 4, gn64.weight, gn64.bias, gn64.eps)), rtol=0, atol=1e-12)
    bn = _timm_bn_act().eval(); ref = bn(x)
    rn = bn_to_batchrenorm(bn)
    assert isinstance(rn, BatchRenorm) and isinstance(rn.act, nn.SiLU)
    assert torch.equal(rn(x), ref)                                   # eval output identical, activation included
    assert set(rn.state_dict()) == set(_timm_bn_act().state_dict())  # same keys as timm's layer

def test_timm_efficientnet_conversions_and_pool():
    timm = pytest.importorskip('timm')
    torch.manual_seed(0)
    m = timm.create_model('efficientnet_b0', pretrained=False, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32); ref = m(x)
    n_act = sum(_is_act(mm) for mm in m.modules())
    assert n_act > 0
    m2 = bn_to_batchrenorm(m)
    assert not bns(m2) and all(isinstance(mm, BatchRenorm) for mm in m2.modules() if isinstance(mm, nn.modules.batchnorm._BatchNorm))
    assert sum(_is_act(mm) for mm in m2.modules()) == n_act
    assert torch.equal(m2(x), ref)
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); g = bn_to_groupnorm(timm.create_model('efficientnet_b0', pretrained=False))
    assert sum(isinstance(mm, nn.GroupNorm) and _is_act(mm) for mm in g.modules()) == n_act

def _is_act(m): return isinstance(getattr(m, 'act', None), nn.SiLU)

def test_pool_with_a_timm_norm_act_layer():
    "'pool' running statistics of a BatchNormAct2d equal the large batch's (lr 0: the weights stay put)"
    pytest.importorskip('timm')
    def learner(bs, cbs):
        torch.manual_seed(0)
        model = nn.Sequential(_timm_bn_act(3).train(), nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
        g = torch.Generator().manual_seed(1)
        ds = torch.utils.data.TensorDataset(torch.randn(40, 3, 6, 6, generator=g)*2+1, torch.randint(0, 2, (40,), generator=g))
        return as_float64(Learner(make_dls(ds, bs), model, loss_func=nn.CrossEntropyLoss(), lr=0., cbs=cbs))
    big = learner(16, []); fit_quiet(big, 1)
    small = learner(4, [GradientAccumulation(n_step=4), BatchNormAccumulation('pool')]); fit_quiet(small, 1)
    b, s = big.model[0], small.model[0]
    assert int(s.num_batches_tracked) == int(b.num_batches_tracked) == 3
    for name in ('running_mean', 'running_var'):
        got, want = getattr(s, name), getattr(b, name)
        assert ((got-want).norm()/want.norm()).item() <= STATS_TOL

def test_pool_counts_every_rank_for_syncbatchnorm(monkeypatch):
    "SyncBatchNorm's statistics cover all ranks' micro-batches: 'pool' weighs each by the global count (local x world)"
    import types, accum_callback.core.distributed as dmod
    monkeypatch.setattr(dmod, 'dist', types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                                             get_world_size=lambda group=None: 2))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, generator=g)*torch.tensor([1., 2., 3.]) + 1
    ds = TensorDataset(x, torch.randint(0, 2, (12,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.SyncBatchNorm(3), nn.Linear(3, 2))   # one process: SyncBatchNorm runs as BatchNorm
    learn = as_float64(Learner(make_dls(ds, 4), model, loss_func=nn.CrossEntropyLoss(), lr=0.,
                               cbs=[GradientAccumulation(n_step=3), BatchNormAccumulation('pool')]))
    fit_quiet(learn, 1)
    parts = x.split(4)
    # what SyncBatchNorm reports per micro-batch (here: the local statistics), weighed by the global count 2 x 4
    n = torch.tensor([2.*len(p) for p in parts], dtype=torch.float64)[:, None]
    means = torch.stack([p.double().mean(0) for p in parts]); vars_ = torch.stack([p.double().var(0) for p in parts])
    mean = (n*means).sum(0)/n.sum()
    var = ((n-1)*vars_ + n*(means-mean)**2).sum(0)/(n.sum()-1)
    bn = learn.model[0]
    assert torch.allclose(bn.running_mean, 0.1*mean, rtol=1e-10) and torch.allclose(bn.running_var, 0.9 + 0.1*var, rtol=1e-10)
    assert int(bn.num_batches_tracked) == 1

# -- activation checkpointing (issue 43) ------------------------------------------------------------------------------
class CkptNet(nn.Module):
    "`BNNet`'s BatchNorm blocks inside `torch.utils.checkpoint` (or not): the same function, the same parameters"
    def __init__(self, ckpt=None, seed=0):
        super().__init__(); self.net,self.ckpt = BNNet(seed=seed),ckpt
    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        n = self.net
        if self.ckpt is None: return n(x)
        if self.ckpt: x = x.detach().requires_grad_()   # the reentrant form back-propagates only into inputs that need it
        a = checkpoint(lambda t: n.bn1(n.l1(t)), x, use_reentrant=self.ckpt)
        b = checkpoint(lambda t: n.bn2(n.l1b(t).view(-1, 4, 4)).flatten(1), x, use_reentrant=self.ckpt)
        return n.l2(F.relu(torch.cat([a, b], 1)))

@pytest.mark.parametrize('mode', ['pool', 'momentum'])
@pytest.mark.parametrize('reentrant', [True, False])
@pytest.mark.parametrize('ga_kw', [dict(n_step=3), dict(n_step=1, micro_bs=2)])
def test_checkpointed_batchnorm_counts_each_micro_batch_once(mode, reentrant, ga_kw):
    """A forward recomputed during the backward (activation checkpointing) is no micro-batch: the running statistics and
    weights equal the same run without checkpointing (before: 'pool' pooled the items twice, 2.4e-3 off; 'momentum'
    updated twice per micro-batch, 0.29 apart), and `num_batches_tracked` counts each window (or micro-batch) once"""
    ds = make_data(44, seed=1)
    runs = []
    for ckpt in (None, reentrant):
        learn = make_learner(ds, 4, model=CkptNet(ckpt), lr=0.05, cbs=[*accumulation(**ga_kw), BatchNormAccumulation(mode)], dtype=F64)
        fit_quiet(learn, 2); runs.append(learn)
    a,b = bn_state(runs[0].model),bn_state(runs[1].model)
    assert_stats_match(b, a)
    assert rel_err(torch.cat([p.detach().flatten() for p in runs[1].model.parameters()]),
                   torch.cat([p.detach().flatten() for p in runs[0].model.parameters()])) <= STATS_TOL
    assert rel_err(a['net.bn1.running_mean'], bn_state(CkptNet())['net.bn1.running_mean']) > 1e-2   # it counted

# -- torch.compile (issue 43) -------------------------------------------------------------------------------------------
def _compiled_fit(cbs, n_step, seed=0):
    "A `torch.compile`d BNNet trained one epoch; the graphs dynamo compiled (a counting backend that runs them eagerly)"
    torch._dynamo.reset()
    graphs = []
    def backend(gm, example_inputs): graphs.append(gm); return gm.forward
    learn = make_learner(make_data(96, seed=1), 4, model=torch.compile(BNNet(seed=seed), backend=backend), lr=0.05,
                         cbs=[GradientAccumulation(n_step=n_step), *cbs], dtype=F64)
    fit_quiet(learn, 1)
    return learn,len(graphs)

@pytest.mark.parametrize('mode', ['pool', 'momentum'])
def test_compiled_model_compiles_no_graph_more(mode):
    """'pool' made dynamo guard on the micro-batch's place in the window (`len(bank.counts[l])`): one graph per place, and
    at n_step=12 torch's recompile limit (8) sent the later places to eager. Now the hooks trace the same at every
    micro-batch: as many graphs as without our BatchNorm callback, and the statistics of the eager model's run"""
    _,plain = _compiled_fit([], 12)
    learn,n = _compiled_fit([BatchNormAccumulation(mode)], 12)
    assert n == plain, (n, plain)
    eager = make_learner(make_data(96, seed=1), 4, model=BNNet(seed=0), lr=0.05,
                         cbs=[GradientAccumulation(n_step=12), BatchNormAccumulation(mode)], dtype=F64)
    fit_quiet(eager, 1)
    assert_stats_match(bn_state(learn.model._orig_mod), bn_state(eager.model))

def test_compiled_model_recomputes_the_eager_models_statistics():
    """`precise=N` on a `torch.compile`d model: the recomputation runs the compiled module (its layers at momentum 1
    with a forward hook each, in eval mode around them) and sets the statistics the eager model's run gets"""
    learn,_ = _compiled_fit([BatchNormAccumulation('pool', precise=40)], 4)
    eager = make_learner(make_data(96, seed=1), 4, model=BNNet(seed=0), lr=0.05,
                         cbs=[GradientAccumulation(n_step=4), BatchNormAccumulation('pool', precise=40)], dtype=F64)
    fit_quiet(eager, 1)
    assert_stats_match(bn_state(learn.model._orig_mod), bn_state(eager.model))
    bns = [m for m in learn.model._orig_mod.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and all(m.momentum == 0.1 for m in bns)   # put back
