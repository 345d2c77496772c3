"""BatchNormAccumulation('window'): every optimizer step's gradient and the running statistics are those of one large
batch of the window's samples (float64), whatever the window's cut; the approximate variant, the check, resume"""
import copy, warnings
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback
from fastai.optimizer import SGD
from hypothesis import given, settings, strategies as st, HealthCheck

from accum_callback import BatchNormAccumulation, GradientAccumulation, MicroBatching
from accum_callback.batchnorm.window_stats import WINDOW_EXACT_MAX_LAYERS, WindowStats
from helpers import make_data, make_learner, rel_err

GRAD_TOL = 1e-10   # relative (norm) error of a float64 step's gradient against the large batch's
STATS_TOL = 1e-12  # relative error of float64 running statistics against the large batch's

pytestmark = pytest.mark.usefixtures('one_thread')

class Net(nn.Module):
    "BatchNorm on a layer's output (2d) and on (N,C,L) input, a residual path around one, ReLU in place after each"
    def __init__(self, n_in=5, n_bn=3, momentum=0.1, seed=0):
        super().__init__(); torch.manual_seed(seed)
        self.inp = nn.Linear(n_in, 16)
        def blk(): return nn.Sequential(nn.BatchNorm1d(16, momentum=momentum), nn.ReLU(inplace=True), nn.Linear(16, 16))
        self.blocks = nn.ModuleList([blk() for _ in range(n_bn-1)])
        self.bn3 = nn.BatchNorm1d(4, momentum=momentum)
        self.out = nn.Linear(16, 3)
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks: h = h + b(h)
        h = F.relu(self.bn3(h.view(-1, 4, 4))).flatten(1)
        return self.out(h)

class StepGrads(Callback):
    "Each optimizer step's gradient against the large batch's, from the model and loader batch of the window's start"
    order = GradientAccumulation.order+2   # after the accumulation's `before_step` scaled the window's gradient
    def before_fit(self): self.errs,self.start = [],None
    def before_batch(self):
        p = self.learn.micro_batching.piece
        if self.training and p.start == 0:
            self.start = (copy.deepcopy(self.model), self.learn.micro_batching.loader.batch)
    def before_step(self):
        if not self.learn.gradient_accumulation.window.stepped: return
        m,(x,y) = copy.deepcopy(self.start[0]),self.start[1]
        m.train(); m.zero_grad()
        self.learn.loss_func(m(x), y).backward()
        ref = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        got = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        self.errs.append(rel_err(got, ref))

def window_learner(n, bs, size, mode='window', n_bn=3, lr=0.05, cbs=(), **kw):
    ds = make_data(n)
    return make_learner(ds, bs, model=Net(n_bn=n_bn), lr=lr, dtype=torch.float64,
                        cbs=[GradientAccumulation(n_step=1), MicroBatching(size), BatchNormAccumulation(mode), *cbs],
                        **kw)

def fit(learn, n=1):
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.fit(n)

# even pieces; uneven pieces; uneven and a partial last batch
@pytest.mark.parametrize('n,bs,size', [(48, 16, 4), (46, 16, 5), (30, 12, 7)])
def test_every_step_is_the_large_batch(n, bs, size):
    spy = StepGrads()
    learn = window_learner(n, bs, size, cbs=[spy])
    fit(learn, 2)
    assert len(spy.errs) == 2*-(-n//bs)
    assert max(spy.errs) < GRAD_TOL, spy.errs

def test_running_stats_are_the_large_batch():
    "lr=0: the weights stay, and each window's update is the large batch's (momentum 0.1 and None)"
    for mom in (0.1, None):
        ds = make_data(40)
        a = make_learner(ds, 10, model=Net(momentum=mom), lr=0., dtype=torch.float64,
                         cbs=[GradientAccumulation(n_step=1), MicroBatching(3), BatchNormAccumulation('window')])
        b = make_learner(ds, 10, model=Net(momentum=mom), lr=0., dtype=torch.float64)
        fit(a, 2); fit(b, 2)
        for k,v in b.model.state_dict().items():
            if 'running' in k or 'num_batches' in k:
                assert rel_err(a.model.state_dict()[k].double(), v.double()) < STATS_TOL, k

def test_without_the_mode_steps_differ():
    "The contract can fail: plain accumulation (ghost batch norm) on the same cut is far from the large batch"
    spy = StepGrads()
    ds = make_data(32)
    learn = make_learner(ds, 16, model=Net(), lr=0.05, dtype=torch.float64,
                         cbs=[GradientAccumulation(n_step=1), MicroBatching(4), spy])
    fit(learn)
    assert min(spy.errs) > 1e-3

def test_approx_keeps_window_forward():
    "'window-approx': the forward is the large batch's (same loss), the gradient near it but not exact"
    spy = StepGrads()
    learn = window_learner(48, 16, 4, mode='window-approx', cbs=[spy])
    fit(learn)
    assert learn.batch_norm_accumulation.window_variant == 'approx'
    assert 1e-10 < max(spy.errs) < 0.5

def test_deep_net_falls_back_and_says_so():
    learn = window_learner(32, 16, 8, n_bn=WINDOW_EXACT_MAX_LAYERS+1)
    with pytest.warns(UserWarning, match='approximate variant is in force'): learn.fit(1)

def test_refuses_what_it_cannot_measure():
    ds = make_data(32)
    learn = make_learner(ds, 8, model=Net(), cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('window')])
    with pytest.raises(ValueError, match='MicroBatching'): learn.fit(1)
    learn = make_learner(ds, 8, model=Net(),
                         cbs=[GradientAccumulation(n_step=2), MicroBatching(4), BatchNormAccumulation('window')])
    with pytest.raises(ValueError, match='several loader batches'): learn.fit(1)

def test_check_says_exact_for_the_exact_variant():
    learn = window_learner(48, 16, 4)
    rep = learn.check_accumulation()
    assert rep.exact and rep.rel_error < GRAD_TOL, rep
    approx = window_learner(48, 16, 4, mode='window-approx').check_accumulation()
    assert not approx.exact and 'batchnorm' in approx.causes, approx
    pool = window_learner(48, 16, 4, mode='pool').check_accumulation()
    assert not pool.exact and 'batchnorm' in pool.causes   # the check can say NOT exact on the same cut

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(9, 40), bs=st.integers(4, 16), size=st.integers(2, 8), n_bn=st.integers(1, 3),
       seed=st.integers(0, 3))
def test_any_cut_is_the_large_batch(n, bs, size, n_bn, seed):
    "Any number of items, loader batch and micro-batch size (uneven pieces, a partial last window), 1 to 3 BN layers"
    if n % bs == 1 or min(bs, n % bs or bs) < 2: return   # (a BatchNorm cannot train on one item, large batch or not)
    spy = StepGrads()
    ds = make_data(n, seed=seed)
    learn = make_learner(ds, bs, model=Net(n_bn=n_bn, seed=seed), lr=0.05, dtype=torch.float64,
                         cbs=[GradientAccumulation(n_step=1), MicroBatching(size), BatchNormAccumulation('window'),
                              spy])
    fit(learn)
    assert spy.errs and max(spy.errs) < GRAD_TOL, spy.errs

class Boom(Exception): pass
class RaiseAt(Callback):
    "Raises at the `at`-th training micro-batch (a window in progress), as a crash would"
    order = 99
    def __init__(self, at): self.at,self.k = at,0
    def after_batch(self):
        if self.training:
            self.k += 1
            if self.k == self.at: raise Boom('the run is cut here')

def test_resume_is_bitwise(tmp_path):
    from accum_callback import Checkpoint
    def make(*cbs): return window_learner(40, 12, 5, cbs=[Checkpoint(tmp_path/'ck', every=('1ep', '1ba')), *cbs])
    ref = window_learner(40, 12, 5); fit(ref, 2)
    cut = make(RaiseAt(7))
    with warnings.catch_warnings(), pytest.raises(Boom): warnings.simplefilter('ignore'); cut.fit(2)
    again = make(); fit(again, 2)
    for (k,a),b in zip(ref.model.state_dict().items(), again.model.state_dict().values()): assert torch.equal(a, b), k

def test_window_state_round_trip():
    "A checkpoint between a window's micro-batches carries its statistics: loaded, the forward normalises alike"
    torch.manual_seed(0)
    m = Net().double(); x = torch.randn(12, 5, dtype=torch.float64)
    bn = [l for l in m.modules() if isinstance(l, nn.BatchNorm1d)]
    a = WindowStats(bn, exact=True)
    a.prepare(3, lambda j: m(x[4*j:4*j+4]).square().mean())
    a.on = True; out = m(x[:4]); st = a.state(); a.remove()
    b = WindowStats(bn, exact=True); b.load_state(st); b.on = True
    assert torch.equal(m(x[:4]), out); b.remove()
    assert not torch.equal(m(x[:4]), out)   # (without the window's statistics: the micro-batch's own)
