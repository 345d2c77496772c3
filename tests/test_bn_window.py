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

def test_refuses_syncbatchnorm_naming_plain_batchnorm():
    from accum_callback.batchnorm.window_stats import window_bn_layers
    with pytest.raises(ValueError, match='SyncBatchNorm.*plain BatchNorm'):
        window_bn_layers(nn.Sequential(nn.SyncBatchNorm(4)))

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

# -- under DDP: the window is every rank's micro-batches, as one large batch of all ranks' samples -------------------
# 2 (and 3) gloo processes, float64; rank r's inputs shifted by r, so that each rank's own statistics are far from the
# window's; the oracle: one process, one large batch of every rank's loader batch per step
DDP_TOL = 1e-10   # relative error of float64 weights and running statistics against the one-process large batch's
DDP_LR = 0.05
DDP_RUNS = dict(
    even    = dict(sizes=[24, 24], bs=8, size=3),
    uneven  = dict(sizes=[22, 24], bs=8, size=3),   # rank 0's last loader batch: 2 micro-batches, rank 1's: 3
    approx  = dict(sizes=[24, 24], bs=8, size=3, mode='window-approx'),
)
DDP_THREE = dict(sizes=[16, 16, 14], bs=8, size=3)   # 3 ranks: rank 2's last loader batch, 2 micro-batches

@pytest.fixture(scope='module')
def ddp_runs(tmp_path_factory):
    import ddp_worker as W
    from accum_callback.testing import launch_gloo
    d = tmp_path_factory.mktemp('bn_window_ddp')
    scen = dict(DDP_RUNS, resume=dict(DDP_RUNS['even'], cut=(str(d), 8)))
    rs = launch_gloo(W.bn_window_ranks, kwargs=dict(scenarios=scen), timeout=180)
    three = launch_gloo(W.bn_window_ranks, world=3, timeout=180,
                        kwargs=dict(scenarios=dict(three=DDP_THREE)))
    out = {k: [r[k] for r in rs] for k in scen}
    out['three'] = [r['three'] for r in three]
    for k,v in out.items():
        for r in v: assert 'error' not in r, (k, r['error'])
    return out

def big_batch(ranks, per_rank=False):
    """One process: each step on the large batch of every rank's loader batch (`per_rank`: each rank's batch normalised
    by itself, the gradients joined by their counts, as DDP without the window's pooling over ranks would)"""
    m = Net().double(); m.train()
    for bs in zip(*[r['batches'] for r in ranks]):
        m.zero_grad()
        if per_rank:
            n = sum(len(b[0]) for b in bs)
            for x,y in bs: (F.mse_loss(m(x), y)*len(x)/n).backward()
        else: F.mse_loss(m(torch.cat([b[0] for b in bs])), torch.cat([b[1] for b in bs])).backward()
        with torch.no_grad():
            for p in m.parameters(): p -= DDP_LR*p.grad
    stats = {k: v for k,v in m.state_dict().items() if 'running' in k or 'num_batches' in k}
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]),stats

@pytest.mark.parametrize('name', ['even', 'uneven', 'three'])
def test_ddp_is_the_large_batch_of_all_ranks(ddp_runs, name):
    ranks = ddp_runs[name]
    params,stats = big_batch(ranks)
    sizes = (DDP_THREE if name == 'three' else DDP_RUNS[name])['sizes']
    assert len(ranks[0]['batches']) == 2*-(-sizes[0]//8) and all(r['variant'] == 'exact' for r in ranks)
    for r in ranks:
        assert torch.equal(r['params'], ranks[0]['params'])   # every rank the same weights and running statistics
        assert rel_err(r['params'], params) < DDP_TOL
        for k,v in stats.items():
            assert rel_err(r['stats'][k].double(), v.double()) < DDP_TOL, k
    if name == 'even':   # the contract can fail: each rank's window normalised by itself is far from it
        assert rel_err(ranks[0]['params'], big_batch(ranks, per_rank=True)[0]) > 1e-3

def test_ddp_approx_keeps_the_windows_forward(ddp_runs):
    "'window-approx': each micro-batch's forward on every rank is the large batch's of all ranks, from the same weights"
    ranks = ddp_runs['approx']
    assert all(r['variant'] == 'approx' for r in ranks)
    for w in range(len(ranks[0]['batches'])):
        m = Net().double(); m.load_state_dict(ranks[0]['starts'][w]); m.train()
        ref = m(torch.cat([r['batches'][w][0] for r in ranks])).detach()
        got = torch.cat([torch.cat(r['preds'][w]) for r in ranks])
        assert rel_err(got, ref) < DDP_TOL, w
    assert 1e-10 < rel_err(ranks[0]['params'], big_batch(ranks)[0]) < 0.5   # (the gradient is not the exact one)

def test_ddp_resume_is_bitwise(ddp_runs):
    "Cut mid-window under DDP, resumed from the checkpoint: the weights of the run that was not cut"
    for a,b in zip(ddp_runs['resume'], ddp_runs['even']):
        assert a['cut'] and len(a['batches']) < len(b['batches'])   # (cut, then resumed: not trained again from start)
        assert torch.equal(a['params'], b['params'])
        for k,v in b['stats'].items(): assert torch.equal(a['stats'][k], v), k
