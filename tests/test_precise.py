"""(Modules `precise` and `bn_check`: `learn.check_batchnorm()`.) BatchNorm statistics of the current weights (issue 32): `update_bn_stats` and `BatchNormAccumulation(precise=N)`
against the exact statistics of the same items in one pass. The oracle runs the same micro-batches through a float64
copy of the model (BatchNorm normalising each micro-batch with its own statistics, as the recomputation does),
catches every BatchNorm layer's inputs, and takes their mean and unbiased variance over all of them at once."""
import copy, random
import pytest, torch, torch.nn as nn
from fastai.callback.core import Callback
from torch.utils.data import TensorDataset

from accum_callback import BatchNormAccumulation, GradientAccumulation, MicroBatching, update_bn_stats
from accum_callback.batchnorm.precise import precise_bn_stats, training_items
from accum_callback.testing import launch_gloo
from helpers import DISTRIBUTED_KINDS, fit_quiet, floor_tol, make_learner

TOL = 1e-6   # relative, float64 against float64

class BNNet(nn.Module):
    "Two BatchNorm layers (a 2d after a conv, a 1d after a linear): the second's inputs depend on the first's normalisation"
    def __init__(self, seed=0):
        super().__init__(); torch.manual_seed(seed)
        self.c,self.b1,self.l,self.b2,self.h = nn.Conv2d(3, 6, 3),nn.BatchNorm2d(6),nn.Linear(6*6*6, 10),nn.BatchNorm1d(10),nn.Linear(10, 3)
    def forward(self, x): return self.h(torch.relu(self.b2(self.l(torch.relu(self.b1(self.c(x))).flatten(1)))))

def images(n=40, seed=0, shift=0.):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(2 + shift + 3*torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))

def oracle(model, batches)->list:
    "Every BatchNorm layer's inputs over `batches` in one float64 tensor each: (mean, unbiased var) per layer"
    m = copy.deepcopy(model).double().eval()
    bns = [x for x in m.modules() if isinstance(x, nn.modules.batchnorm._BatchNorm)]
    for bn in bns: bn.train()
    seen = {bn: [] for bn in bns}
    hs = [bn.register_forward_pre_hook(lambda mod, inp: seen[mod].append(inp[0].detach())) for bn in bns]
    with torch.no_grad():
        for (xb,) in batches: m(xb.double())
    for h in hs: h.remove()
    out = []
    for bn in bns:
        x = torch.cat(seen[bn]).transpose(0, 1).reshape(bn.num_features, -1)
        out.append((x.mean(1), x.var(1, unbiased=True)))
    return out

def rel(a, b): return float((a.double()-b.double()).norm()/b.double().norm())

def stats(model): return [(m.running_mean.clone(), m.running_var.clone()) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

def test_recomputed_statistics_are_the_exact_statistics_of_the_items():
    "Micro-batches of 5 (and a last of 3): each layer's running mean and variance are those of all their inputs at once"
    model = BNNet().double()
    x = images().tensors[0][:38]
    batches = [(x[i:i+5],) for i in range(0, 38, 5)]
    before = {k: v.clone() for k,v in model.state_dict().items()}
    n = update_bn_stats(model, batches)
    assert n == 38
    for (m,v),(om,ov) in zip(stats(model), oracle(model, batches)): assert rel(m, om) <= TOL and rel(v, ov) <= TOL
    after = model.state_dict()
    for k,v in before.items():   # only the running statistics changed
        if 'running' not in k: assert torch.equal(v, after[k]), k
    assert model.training   # modes put back

def test_precise_in_the_callback_changes_nothing_else_and_equals_the_oracle():
    """`BatchNormAccumulation('pool', precise=24)` with micro_bs=3 pieces: the final running statistics are the oracle's
    over the pieces `training_items` gives for the last epoch; the weights, the optimizer state and the sample order are
    those of the same fit without `precise` (the recomputation touches no RNG and not the training loader)"""
    def run(precise):
        torch.manual_seed(0); random.seed(0)
        learn = make_learner(images(), 8, cbs=[GradientAccumulation(n_step=2), MicroBatching(3), BatchNormAccumulation('pool', precise=precise)],
                             model=BNNet(), loss_func=nn.CrossEntropyLoss(), dtype=torch.float64, shuffle=True)
        fit_quiet(learn, 2)
        return learn
    a,b = run(24),run(None)
    wa,wb = [p.detach() for p in a.model.parameters()],[p.detach() for p in b.model.parameters()]
    assert all(torch.equal(x, y) for x,y in zip(wa, wb))
    bna = next(cb for cb in a.cbs if isinstance(cb, BatchNormAccumulation))
    assert bna.precise_items >= 24
    items = list(training_items(a, 24, 3, seed=1))
    assert [len(x[0]) for x in items] == [3, 3, 2]*3 and sum(len(x[0]) for x in items) == bna.precise_items   # loader batches of 8 in 3+3+2
    for (m,v),(om,ov) in zip(stats(a.model), oracle(a.model, items)): assert rel(m, om) <= TOL and rel(v, ov) <= TOL
    assert any(rel(m, n) > 1e-3 for (m,_),(n,_) in zip(stats(a.model), stats(b.model)))   # ... and they are not 'pool''s

def test_validation_sees_the_recomputed_statistics():
    "The epoch's validation runs after the recomputation (it is done in after_train): its loss is the precise model's"
    learn = make_learner(images(), 8, cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool', precise=16)], model=BNNet(),
                         loss_func=nn.CrossEntropyLoss(), dtype=torch.float64)
    fit_quiet(learn, 1)
    fit_loss = learn.recorder.values[-1][1]
    assert abs(learn.validate()[0] - fit_loss) <= 1e-12

class SubBN2d(nn.BatchNorm2d):
    "A subclass (as timm's norm-act layers are): its running update is not known to be torch's, so it is measured apart"

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_plain_layers_statistics_read_back_and_others_measured_agree_whatever_the_buffers_held(dtype):
    """Plain BatchNorm layers give their micro-batch statistics through their own running update (momentum 1, read back
    after each forward); a subclass is measured by a hook. Both ways the exact statistics of the items, also when the
    buffers held nan and inf before (0 x nan is nan), with a momentum of None (cumulative) or 0.5, and a layer called
    twice in one forward; the layers' momentum and buffers are put back"""
    class Twice(BNNet):
        def __init__(self):
            super().__init__(); self.b1 = SubBN2d(6); self.b0 = nn.BatchNorm2d(3, momentum=None)
        def forward(self, x):
            x = self.b0(x); x = self.b0(x + 1.)   # one layer, two calls
            return super().forward(x)
    model = Twice().to(dtype)
    model.b2.momentum = 0.5
    x = images().tensors[0][:38].to(dtype)
    batches = [(x[i:i+5],) for i in range(0, 38, 5)]
    with torch.no_grad():
        want_model = copy.deepcopy(model)
        for bn in (model.b0, model.b1, model.b2): bn.running_mean.fill_(float('nan')); bn.running_var.fill_(float('inf'))
    before = [(bn.momentum, bn.running_mean.clone(), bn.running_var.clone()) for bn in (model.b0, model.b1, model.b2)]
    got = precise_bn_stats(model, batches)
    for bn,(mom,m,v) in zip((model.b0, model.b1, model.b2), before):
        assert bn.momentum == mom and torch.equal(bn.running_mean.isnan(), m.isnan()) and torch.equal(bn.running_var, v)
    def inputs(o, cast):
        "Each BatchNorm's inputs over all the batches (channels x items), through the model `o` in training mode"
        seen = {}
        hs = [bn.register_forward_pre_hook(lambda mod, inp: seen.setdefault(mod, []).append(inp[0].detach()))
              for bn in (o.b0, o.b1, o.b2)]
        o.eval(); [bn.train() for bn in (o.b0, o.b1, o.b2)]
        with torch.no_grad():
            for (xb,) in batches: o(cast(xb))
        for h in hs: h.remove()
        return [torch.cat(seen[b]).transpose(0, 1).reshape(b.num_features, -1) for b in (o.b0, o.b1, o.b2)]
    want = inputs(copy.deepcopy(want_model).double(), lambda x: x.double())
    tol = TOL
    if dtype == torch.float32:   # float32's rounding on these statistics: computed from float32's own inputs
        low = inputs(copy.deepcopy(want_model), lambda x: x)
        tol = floor_tol([rel(f(l), f(a)) for l,a in zip(low, want) for f in (lambda t: t.mean(1), lambda t: t.var(1))])
    for bn,a in zip((model.b0, model.b1, model.b2), want):
        s = got[bn]
        assert s.n == a.shape[1] and rel(s.mean, a.mean(1)) <= tol and rel(s.var, a.var(1)) <= tol, (type(bn), rel(s.var, a.var(1)))

def test_bad_input():
    with pytest.raises(ValueError, match="precise.*'freeze'"): BatchNormAccumulation('freeze', precise=10)
    with pytest.raises(ValueError, match='precise'): BatchNormAccumulation('pool', precise=0)
    with pytest.raises(TypeError, match='precise'): BatchNormAccumulation('pool', precise=2.5)

def test_under_ddp_and_fsdp2_the_statistics_are_every_ranks():
    "2 gloo processes, each its own half of the items: every rank's running statistics are those of all the items"
    import ddp_worker as W
    r0,r1 = launch_gloo(W.precise_ranks, timeout=120)
    model = BNNet().double()
    x = torch.cat([images(seed=0).tensors[0][:20], images(seed=1, shift=1.).tensors[0][:20]])   # what the two ranks hold
    for kind in DISTRIBUTED_KINDS:   # (FSDP2 from torch 2.6)
        a,b = r0[kind],r1[kind]
        assert 'error' not in a, a.get('error')
        per_rank = [[(x[r*20 + i: r*20 + i + 5],) for i in range(0, 20, 5)] for r in (0, 1)]
        want = oracle(model, per_rank[0] + per_rank[1])
        for s in (a['stats'], b['stats']):
            for (m,v),(om,ov) in zip(s, want): assert rel(m, om) <= TOL and rel(v, ov) <= TOL, kind
        assert a['n'] == b['n'] == 40

def test_check_batchnorm_measures_both_ways_and_changes_nothing():
    """`learn.check_batchnorm()`: the validation with the running statistics is the Learner's own; with recomputed
    ones, that of a copy whose statistics `update_bn_stats` set from the same items; the Learner is left as it was"""
    from fastai.metrics import accuracy
    learn = make_learner(images(), 8, cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool')], model=BNNet(),
                         loss_func=nn.CrossEntropyLoss(), dtype=torch.float64)
    learn.metrics = [accuracy]
    fit_quiet(learn, 1)
    state = {k: v.clone() for k,v in learn.model.state_dict().items()}
    rng = torch.get_rng_state()
    r = learn.check_batchnorm(32)
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k,v in state.items()) and torch.equal(torch.get_rng_state(), rng)
    with learn.no_bar(): assert r.running == [float(v) for v in learn.validate()]
    m = copy.deepcopy(learn.model)
    update_bn_stats(m, training_items(learn, 32))
    saved,learn.model = learn.model,m
    with learn.no_bar(): want = [float(v) for v in learn.validate()]
    learn.model = saved
    assert r.precise == want and r.n_items == 32 and len(r.layers) == 2 and r.names == ['valid_loss', 'accuracy']
    assert 'check_batchnorm' in str(r) and ('lag' in r.advice) == (r.precise[0] < r.running[0])
    with pytest.raises(ValueError, match='no BatchNorm'):
        make_learner(images(), 8, model=nn.Sequential(nn.Flatten(), nn.Linear(192, 3)).double(), loss_func=nn.CrossEntropyLoss()).check_batchnorm()

# -- issue 41: frozen layers, the precision of the model, the Recorder -------------------------------------------------
def test_precise_leaves_frozen_layers_and_feeds_the_head_as_training_does():
    """`precise=N` with fastai's `BnFreeze` (the body's BatchNorm frozen in eval, its parameters not training): the frozen
    layer keeps its (pretrained) statistics, and the head's are recomputed with the body normalising by its running
    statistics, as training and inference feed it (before: the frozen layer overwritten, 0.25 -> 0.01-0.32, and the
    head's statistics 5.7% off). `check_batchnorm()` does not list the frozen layer as stale"""
    from fastai.callback.training import BnFreeze
    model = BNNet().double()
    with torch.no_grad(): model.b1.running_mean.fill_(0.25); model.b1.running_var.fill_(4.)
    for p in model.b1.parameters(): p.requires_grad_(False)
    pre = (model.b1.running_mean.clone(), model.b1.running_var.clone())
    learn = make_learner(images(), 8, model=model, loss_func=nn.CrossEntropyLoss(), lr=0.01, dtype=torch.float64,
                         cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool', precise=24), BnFreeze()])
    fit_quiet(learn, 1)
    assert torch.equal(model.b1.running_mean, pre[0]) and torch.equal(model.b1.running_var, pre[1])
    # the oracle: the head's inputs over the same items with the body's BatchNorm in eval mode (frozen)
    m = copy.deepcopy(model).eval(); m.b2.train()
    seen = []
    h = m.b2.register_forward_pre_hook(lambda mod, inp: seen.append(inp[0].detach()))
    with torch.no_grad():
        for xb in training_items(learn, 24, None, seed=0): m(*xb)
    h.remove()
    x = torch.cat(seen)
    assert rel(model.b2.running_mean, x.mean(0)) <= TOL and rel(model.b2.running_var, x.var(0)) <= TOL
    r = learn.check_batchnorm(16)
    assert [l[0] for l in r.layers] == ['b2'], r.layers

def test_precise_statistics_of_a_float64_model_are_float64():
    "Inputs at offset 1e4 with sd 0.01: the recomputed variance of a float64 model is exact (float32 gave 4e-3 off)"
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).double()
    x = 1e4 + 0.01*torch.randn(64, 3, dtype=torch.float64)
    update_bn_stats(nn.Sequential(bn), [(x[i:i+8],) for i in range(0, 64, 8)])
    assert rel(bn.running_var, x.var(0)) <= 1e-9 and rel(bn.running_mean, x.mean(0)) <= 1e-12

def test_check_batchnorm_keeps_the_recorder():
    "fastai's `validate()` empties the Recorder: `check_batchnorm()`, documented to change nothing, keeps its history"
    learn = make_learner(images(), 8, cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool')], model=BNNet(),
                         loss_func=nn.CrossEntropyLoss(), dtype=torch.float64)
    fit_quiet(learn, 2)
    rec = learn.recorder
    before = (list(rec.values), list(rec.losses), list(rec.lrs), list(rec.iters))
    learn.check_batchnorm(16)
    assert (rec.values, rec.losses, rec.lrs, rec.iters) == before and len(before[0]) == 2 and len(before[1]) == 10

class Recomputes(Callback):
    "Which epochs' validations ran after a recomputation (BatchNormAccumulation's `precise_items` set anew)"
    order = 100
    def before_fit(self): self.seen = []
    def before_validate(self):
        bna = next(cb for cb in self.learn.cbs if isinstance(cb, BatchNormAccumulation))
        self.seen.append(getattr(bna, 'precise_items', None)); bna.precise_items = None

@pytest.mark.parametrize('cancel_at', [None, 1])
def test_precise_at_the_end_recomputes_once_and_equals_every_epochs(cancel_at):
    """Issue 38: `precise_at='end'` recomputes before the last epoch's validation only (and at the end of a fit cancelled
    before it): the final statistics are those `precise_at='epoch'` leaves, the weights the same (<= 1e-12, float64)"""
    from fastai.callback.core import CancelFitException
    class Stop(Callback):
        order = 99
        def after_epoch(self):
            if cancel_at is not None and self.epoch == cancel_at: raise CancelFitException()
    def run(at):
        torch.manual_seed(0); random.seed(0)
        probe = Recomputes()
        learn = make_learner(images(), 8, cbs=[GradientAccumulation(n_step=2), BatchNormAccumulation('pool', precise=16, precise_at=at), probe, Stop()],
                             model=BNNet(), loss_func=nn.CrossEntropyLoss(), dtype=torch.float64, shuffle=True)
        fit_quiet(learn, 3)
        return learn,probe.seen
    (a,seen_a),(b,seen_b) = run('end'),run('epoch')
    assert all(x is not None for x in seen_b)
    if cancel_at is None:
        assert [x is not None for x in seen_a] == [False, False, True]
        for (m,v),(n,w) in zip(stats(a.model), stats(b.model)): assert rel(m, n) <= 1e-12 and rel(v, w) <= 1e-12
    else:   # cancelled after epoch 1's validation: recomputed in after_fit, from the items epoch 1's recomputation reads
        assert not any(x is not None for x in seen_a)
        for (m,v),(n,w) in zip(stats(a.model), stats(b.model)): assert rel(m, n) <= 1e-12 and rel(v, w) <= 1e-12
    assert all(torch.equal(x, y) for x,y in zip(a.model.parameters(), b.model.parameters()))
    with pytest.raises(ValueError, match='`precise_at`'): BatchNormAccumulation('pool', precise=8, precise_at='sometimes')
