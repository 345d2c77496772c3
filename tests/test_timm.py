"""timm's models as users build them (`timm.create_model(name, drop_path_rate=..., drop_block_rate=..., drop_rate=...)`,
timm's default init, which zero-initialises the last norm of each residual branch): regularisers inside norm-act layers
keep the Learner's mode under every BatchNorm mode and in `precise`; `check_accumulation()` names them; and a matrix of
the families users fine-tune, each with the regularisers its timm recipe turns on, under `GradientAccumulation` + each
BatchNorm mode (+ `precise`), its verdict and causes held to a truth measured here, apart from the check. float64, small
inputs (32 px); the larger families behind `-m slow`."""
import copy, warnings
import pytest
import torch, torch.nn as nn
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback
from fastai.learner import Learner

from accum_callback import BatchNormAccumulation, GradientAccumulation, update_bn_stats
from accum_callback.compat.torch import BatchNormBase
from accum_callback.batchnorm.norm_layers import bn_to_batchrenorm, bn_to_groupnorm, set_norm_mode
from accum_callback.batchnorm.precise import precise_bn_stats
from helpers import Float64Smoothing, make_dls, rel_err

timm = pytest.importorskip('timm')
from timm.layers import DropBlock2d, DropPath

REGULARISERS = (nn.Dropout, DropPath, DropBlock2d)
TOL = 1e-10   # float64: an exact accumulation is at 1e-16 here, the smallest regulariser effect measured 1e-3

def _model(name, seed=0, **kw):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return timm.create_model(name, pretrained=False, num_classes=3, **kw).double()

def _data(n=32, px=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, px, px, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))

def _learner(model, cbs, n=32, bs=8, px=32):
    learn = Learner(make_dls(_data(n, px), bs, valid=_data(8, px, seed=2)), model, loss_func=nn.CrossEntropyLoss(), lr=1e-3,
                    cbs=[*cbs, Float64Smoothing()])
    learn.recorder.train_metrics = False
    return learn

def _regularisers(model): return [m for m in model.modules() if isinstance(m, REGULARISERS)]

class _Counter:
    "Forward calls of each regulariser in training mode (`active`) and in all"
    def __init__(self, model):
        self.active = self.calls = 0
        self.handles = [m.register_forward_hook(self) for m in _regularisers(model)]
    def __call__(self, mod, inp, out):
        self.calls += 1; self.active += int(mod.training)
    def remove(self):
        for h in self.handles: h.remove()

# -- 1. precise: the recomputation with a DropBlock inside the norm-act layers ----------------------------------------------
def _one_pass_oracle(model, batches):
    """Each BatchNorm layer's input over `batches`, gathered with hooks, each micro-batch normalised by its own statistics
    (the layers in training mode) and every regulariser off, the mean and unbiased variance of all of them in one pass"""
    m = copy.deepcopy(model).eval()
    bns = [b for b in m.modules() if isinstance(b, BatchNormBase)]
    for b in bns: b.training = True
    seen = {b: [] for b in bns}
    hs = [b.register_forward_pre_hook(lambda mod, inp: seen[mod].append(inp[0].detach().transpose(0, 1).reshape(inp[0].shape[1], -1))) for b in bns]
    with torch.no_grad():
        for x in batches: m(x)
    for h in hs: h.remove()
    orig = [b for b in model.modules() if isinstance(b, BatchNormBase)]
    return {o: (torch.cat(seen[b], 1).mean(1), torch.cat(seen[b], 1).var(1)) for o,b in zip(orig, bns)}

def test_precise_with_dropblock_in_norm_act_equals_the_one_pass_oracle():
    model = _model('gernet_s', drop_block_rate=0.3).train()
    blocks = [m for m in model.modules() if isinstance(m, DropBlock2d)]
    assert blocks and all(any(getattr(bn, 'drop', None) is d for bn in model.modules()) for d in blocks)   # inside norm-act
    x = _data(16).tensors[0]
    batches = [x[i:i+4] for i in range(0, 16, 4)]
    count = _Counter(model)
    a = precise_bn_stats(model, batches)
    assert count.calls > 0 and count.active == 0, 'the DropBlock ran in training mode during the recomputation'
    b = precise_bn_stats(model, batches)
    count.remove()
    oracle = _one_pass_oracle(model, batches)
    assert set(a) == set(oracle)
    for bn,s in a.items():
        assert torch.equal(s.mean, b[bn].mean) and torch.equal(s.var, b[bn].var)   # two recomputations: identical
        m,v = oracle[bn]
        assert rel_err(s.mean, m) <= 1e-10 and rel_err(s.var, v) <= 1e-10
    assert all(m.training for m in model.modules())   # every mode put back (the model was in training mode)

def test_update_bn_stats_leaves_the_norm_act_submodules_mode():
    model = _model('gernet_s', drop_block_rate=0.3).eval()
    blocks = [m for m in model.modules() if isinstance(m, DropBlock2d)]
    for d in blocks: d.train()   # a mode the caller chose: kept
    update_bn_stats(model, [_data(8).tensors[0]])
    assert all(d.training for d in blocks) and not any(m.training for m in model.modules() if isinstance(m, BatchNormBase))

# -- 2. 'freeze' and the other modes leave the regularisers as active as without the callback -------------------------------
@pytest.mark.parametrize('name,kw', [('gernet_s', dict(drop_block_rate=0.3)), ('resnet10t', dict(drop_path_rate=0.2, drop_rate=0.2))])
@pytest.mark.parametrize('mode', ['freeze', 'groupnorm', 'pool', 'renorm'])
def test_modes_leave_regularisers_as_active_as_without_the_callback(name, kw, mode):
    def counted(cbs):
        model = _model(name, **kw)
        c = _Counter(model)
        _learner(model, cbs, n=16).fit(1)   # (fastai's progress bar on, as users run it)
        c.remove()
        return c.active, c.calls
    plain = counted([GradientAccumulation(n_step=2)])
    assert plain[0] > 0
    assert counted([GradientAccumulation(n_step=2), BatchNormAccumulation(mode)]) == plain

def test_freeze_puts_the_norm_layers_own_mode_back_after_fit():
    model = _model('gernet_s', drop_block_rate=0.3)
    learn = _learner(model, [GradientAccumulation(n_step=2), BatchNormAccumulation('freeze')], n=16)
    seen = []
    class Spy(Callback):   # the modes inside a training batch
        def before_batch(self):
            if self.training: seen.append((all(not b.training for b in model.modules() if isinstance(b, BatchNormBase)),
                                           all(d.training for d in _regularisers(model))))
    learn.add_cb(Spy())
    learn.fit(1)
    assert seen and all(a and b for a,b in seen)
    assert not any(m.training for m in model.modules())   # after fit: eval everywhere, as fastai's validation left it

def test_set_norm_mode_touches_the_layer_only():
    bn = timm.layers.BatchNormAct2d(4, drop_layer=lambda: DropBlock2d(0.5))
    bn.eval()
    assert set_norm_mode(bn, True) is bn and bn.training and not bn.drop.training and not bn.act.training

# -- 3. the check names drop-path and DropBlock 'dropout' on timm's default init ---------------------------------------------
@pytest.mark.parametrize('name,kw,mode,causes', [
    ('resnet10t', dict(drop_path_rate=0.2), 'freeze', ('dropout',)),
    ('gernet_s', dict(drop_block_rate=0.3), 'groupnorm', ('dropout',)),
    ('gernet_s', dict(drop_block_rate=0.3), 'freeze', ('dropout',)),
    ('gernet_s', dict(drop_block_rate=0.3), 'pool', ('batchnorm', 'dropout')),   # the DropBlock tested under 'pool'
])
def test_check_names_dropout_on_timms_default_init(name, kw, mode, causes):
    model = _model(name, **kw)
    zero = [m for m in model.modules() if isinstance(m, BatchNormBase) and m.weight is not None and not m.weight.any()]
    assert zero, "timm's zero_init_last: the last norm of each residual branch starts at 0"
    r = _learner(model, [GradientAccumulation(n_step=2), BatchNormAccumulation(mode)]).check_accumulation()
    assert not r.exact and r.causes == causes, r

# -- 4. the timm matrix ------------------------------------------------------------------------------------------------------
# (family, timm name, the regularisers its recipe turns on, extra create_model arguments)
FAMILIES = dict(
    resnet_d=('resnet10t', dict(drop_path_rate=0.05, drop_rate=0.2)),   # ResNet-D (deep stem, avg-pool downsample)
    gernet=('gernet_s', dict(drop_block_rate=0.2)),                     # DropBlock inside BatchNormAct2d
    mobilenetv3=('mobilenetv3_small_050', dict(drop_rate=0.2, drop_path_rate=0.2)),
    regnet=('regnetx_002', dict(drop_path_rate=0.05)),
    convnext=('convnext_atto', dict(drop_path_rate=0.1)),               # LayerNorm: no BatchNorm
    vit=('vit_tiny_patch16_224', dict(drop_path_rate=0.1, img_size=32, patch_size=8)),
    efficientnet=('efficientnet_b0', dict(drop_rate=0.2, drop_path_rate=0.2)),
)
SLOW = {'efficientnet'}
BN_MODES_ = ('pool', 'momentum', 'freeze', 'groupnorm', 'renorm')

def _converted(model, mode):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if mode == 'groupnorm': return bn_to_groupnorm(model)
        if mode == 'renorm': return bn_to_batchrenorm(model)
    return model

def _oracle_grad(model, mode, xs, ys, regs:bool, seed=0):
    """The truth, measured apart from the check: the gradient of micro-batches `xs` accumulated (mean losses weighed by
    their sizes) and of one batch of them, on a copy in training mode as `mode` trains it, with the regularisers on
    (`regs`) or in eval mode"""
    out = []
    for parts in (list(zip(xs, ys)), [(torch.cat(xs), torch.cat(ys))]):
        m = _converted(copy.deepcopy(model), mode).train()
        for r in _regularisers(m): r.train(regs)
        if mode == 'freeze':
            for b in m.modules():
                if isinstance(b, BatchNormBase): set_norm_mode(b, False)
        torch.manual_seed(seed)
        n = sum(len(y) for _,y in parts)
        for x,y in parts: (nn.functional.cross_entropy(m(x), y)*len(y)/n).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None]))
    return out

def _random_in_training(model, mode, x, y)->bool:
    "Does the gradient of one batch change with the RNG's draw (regularisers on)?"
    a = _oracle_grad(model, mode, [x], [y], True, seed=0)[1]
    b = _oracle_grad(model, mode, [x], [y], True, seed=1)[1]
    return not torch.equal(a, b)

def _cells():
    for fam,(name,kw) in FAMILIES.items():
        mark = [pytest.mark.slow] if fam in SLOW else []
        probe = timm.create_model(name, pretrained=False, **kw)
        has_bn = any(isinstance(m, BatchNormBase) for m in probe.modules())
        for mode in (BN_MODES_ if has_bn else (None,)):
            yield pytest.param(fam, mode, id=f'{fam}-{mode}', marks=mark)

@pytest.mark.parametrize('fam,mode', list(_cells()))
def test_timm_matrix(fam, mode):
    """Train one epoch with `GradientAccumulation(n_step=2)` and the mode (`precise` where the mode allows it): the
    regularisers as active as without the callback, the weights finite and moved; then `check_accumulation()`'s verdict
    and causes against the truth measured by `_oracle_grad`"""
    name,kw = FAMILIES[fam]
    model = _model(name, **kw)
    x,y = _data(16).tensors
    # the truth: exact when the accumulated gradient is the one batch's with the regularisers on; 'batchnorm' when it
    # differs with them off (micro-batch statistics); 'dropout' when the regularisers draw at random in training
    on = rel_err(*_oracle_grad(model, mode, [x[:8], x[8:]], [y[:8], y[8:]], True))
    off = rel_err(*_oracle_grad(model, mode, [x[:8], x[8:]], [y[:8], y[8:]], False))
    random_ = _random_in_training(model, mode, x[:8], y[:8])
    want = tuple(c for c,on_ in (('batchnorm', off > TOL), ('dropout', random_ and on > TOL)) if on_)
    assert random_, f'{name}: the recipe regularisers should draw at random in training'

    bna = [] if mode is None else [BatchNormAccumulation(mode, **({} if mode == 'freeze' else dict(precise=16)))]
    learn = _learner(model, [GradientAccumulation(n_step=2), *bna], n=16)
    report = learn.check_accumulation()
    assert report.exact == (on <= TOL) and report.causes == want, (report, on, off)

    before = [p.detach().clone() for p in learn.model.parameters()]
    count = _Counter(learn.model)
    learn.fit(1)
    count.remove()
    plain = _model(name, **kw); pc = _Counter(plain)
    _learner(plain, [GradientAccumulation(n_step=2)], n=16).fit(1)
    pc.remove()
    assert count.active == pc.active > 0   # (the calls differ by precise's forwards, all with the regularisers off)
    after = list(learn.model.parameters())
    assert all(torch.isfinite(p).all() for p in after) and any(not torch.equal(a, b) for a,b in zip(before, after))
    if mode not in (None, 'freeze', 'groupnorm'):   # precise=16 recomputed the statistics: finite, and not the init
        bns = [b for b in learn.model.modules() if isinstance(b, BatchNormBase) and b.running_mean is not None]
        assert bns and all(torch.isfinite(b.running_var).all() for b in bns) and any((b.running_var != 1).any() for b in bns)

# -- 4. micro-batches on timm's families: a classifier head's `reset(num_classes)` is not batch state -----------------------
from accum_callback import MicroBatching
from accum_callback.micro import StatefulModelError, stateful_modules

# the families fine-tuned with a `ClassifierHead` / `NormMlpClassifierHead` (their `reset(num_classes)` rebuilds the layer);
# the larger ones behind `-m slow` (creation alone takes seconds)
# (timm's `test_*` models: its families at their smallest, for the everyday tier)
HEADED = ('test_convnext', 'test_byobnet', 'test_nfnet')
HEADED_SLOW = ('convnext_atto', 'edgenext_xx_small', 'regnetx_002', 'ese_vovnet19b_slim_dw', 'cspresnet50', 'vgg11',
               'nfnet_l0', 'swin_tiny_patch4_window7_224', 'resnetv2_50')

def _headed(name):
    kw = dict(img_size=32, window_size=4) if name.startswith('swin') else {}
    return _model(name, **kw)

@pytest.mark.parametrize('name', [*HEADED, *(pytest.param(n, marks=pytest.mark.slow) for n in HEADED_SLOW)])
def test_timm_heads_are_not_batch_state_and_micro_batches_train(name, one_thread):
    """`timm.create_model`'s models are not refused by `MicroBatching(4)` or `'auto'`: their heads' `reset` needs
    arguments (not fastai's `reset()`); a fit of two loader batches of 8 cut into pieces trains (finite, moved)"""
    model = _headed(name)
    assert any(callable(getattr(m, 'reset', None)) for m in model.modules())   # (the head this test is about)
    assert stateful_modules(model) == ([], [])
    for mb in (4, 'auto'):
        learn = _learner(copy.deepcopy(model), [GradientAccumulation(n_step=1), MicroBatching(mb)], n=16)
        before = [p.detach().clone() for p in learn.model.parameters()]
        learn.fit(1)
        after = list(learn.model.parameters())
        assert all(torch.isfinite(p).all() for p in after) and any(not torch.equal(a, b) for a,b in zip(before, after))

def test_micro_batches_of_a_layernorm_timm_model_step_as_one_batch(one_thread):
    "timm's ConvNeXt (LayerNorm only, no regulariser on): micro-batches of 4 step as one batch of 8, float64"
    model = _model('test_convnext')
    assert not any(isinstance(m, BatchNormBase) for m in model.modules())
    ref = _learner(copy.deepcopy(model), [], n=16); ref.fit(1)
    got = _learner(copy.deepcopy(model), [GradientAccumulation(n_step=1), MicroBatching(4)], n=16); got.fit(1)
    w = lambda l: torch.cat([p.detach().reshape(-1) for p in l.model.parameters()])
    assert rel_err(w(got), w(ref)) <= TOL

def test_vision_learner_timm_bodies_train_under_micro_batches(tmp_path, one_thread):
    "`vision_learner(dls, 'convnext_atto', pretrained=False)` (timm's body, fastai's head) trains under MicroBatching"
    import numpy as np
    from PIL import Image
    from fastai.vision.all import ImageDataLoaders, vision_learner
    rng = np.random.default_rng(0)
    for split,n in (('train', 8), ('valid', 4)):
        for c in ('a', 'b'):
            (tmp_path/split/c).mkdir(parents=True)
            for i in range(n): Image.fromarray((rng.random((32, 32, 3))*255).astype('uint8')).save(tmp_path/split/c/f'{i}.png')
    dls = ImageDataLoaders.from_folder(tmp_path, bs=8, num_workers=0, device='cpu')
    for arch in ('test_convnext', 'test_byobnet'):
        for mb in (4, 'auto'):
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                learn = vision_learner(dls, arch, pretrained=False, cbs=[GradientAccumulation(n_step=1), MicroBatching(mb)])
            assert stateful_modules(learn.model) == ([], [])
            learn.fit(1)
            assert all(torch.isfinite(p).all() for p in learn.model.parameters())

class _Stateful(nn.Module):
    "Holds its last output between batches and says so: fastai's `reset()` (no argument), or the declaration"
    def __init__(self, declare=False):
        super().__init__(); self.lin,self.h = nn.Linear(3*32*32, 3),None
        if declare: self.carries_batch_state = True
        else: self.reset = lambda: setattr(self, 'h', None)
    def forward(self, x):
        out = self.lin(x.flatten(1))
        self.h = out.detach(); return out

@pytest.mark.parametrize('declare', [False, True], ids=['reset()', 'carries_batch_state'])
def test_modules_that_declare_batch_state_are_still_refused(declare):
    learn = _learner(_Stateful(declare).double(), [GradientAccumulation(n_step=1), MicroBatching(4)], n=16)
    with pytest.raises(StatefulModelError, match=r"_Stateful.*declares it"): learn.fit(1)
