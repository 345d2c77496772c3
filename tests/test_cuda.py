"""The `cuda` tier: what a GPU user relies on, each against one big batch where the maths says so. Skipped without a GPU.

`ACCUM_TEST_DEVICE=cpu python -m pytest -m cuda tests/test_cuda.py` dry-runs the tests that need no CUDA-only feature on
the CPU (the mixed-precision, NCCL and CUDA-graph tests still skip there)."""
import copy, os
import pytest, torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import TensorDataset
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientClip
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.optimizer import SGD, Adam

from fastai.callback.core import Callback
from accum_callback import GradientAccumulation, BatchNormAccumulation, MicroBatching
from accum_callback.batchnorm.norm_layers import BatchRenorm
from accum_callback.batchnorm.callback import accumulated_momentum
from accum_callback.core.distributed import count_allreduces
from helpers import MLP, Float64Batches, Float64Smoothing, as64, fit_silent, flat, floor_tol, make_data, rel_err
from accum_callback.testing import OutOfMemoryAbove, free_port

DEVICE = torch.device(os.environ.get('ACCUM_TEST_DEVICE', 'cuda'))
ON_GPU = DEVICE.type == 'cuda'
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason='needs an NVIDIA GPU')]
needs_gpu = pytest.mark.skipif(not ON_GPU, reason='CUDA-only feature (dry run on the CPU)')

def learner(ds, bs, model, cbs=(), opt_func=SGD, lr=0.1, loss_func=F.mse_loss, valid=None):
    v = valid if valid is not None else TensorDataset(*[t[:bs] for t in ds.tensors])
    dls = DataLoaders(DataLoader(ds, bs=bs), DataLoader(v, bs=bs), device=DEVICE)
    learn = Learner(dls, model.to(DEVICE), loss_func=loss_func, opt_func=opt_func, lr=lr, cbs=list(cbs))
    learn.recorder.train_metrics = False
    return learn

class _ScaleLog(Callback):
    "The GradScaler's scale after every step (MixedPrecision drops the scaler at the end of fit)"
    order = MixedPrecision.order+1
    def before_fit(self): self.scales = []
    def after_step(self): self.scales.append(self.learn.scaler.get_scale())

def w(learn): return flat([p.detach().float().cpu() for p in learn.model.parameters()])

def fit_floor(ds, bs, model, cbs=(), opt_func=SGD, lr=0.1, epochs=1, **kw)->tuple:
    """(the big-batch fit, the rounding of its precision on it): `model` fitted on `ds` in batches of `bs` with `cbs`
    (an autocast precision among them), and its weights' relative error against the same fit in float64 without
    them; a tolerance is `floor_tol` of it (the GPU's kernels, TF32 or not, the autocast dtype: measured, not
    assumed)"""
    low = fit_silent(learner(ds, bs, copy.deepcopy(model), cbs, opt_func, lr, **kw), epochs)
    ds64 = TensorDataset(*as64(list(ds.tensors)))
    keep = [c for c in cbs if not isinstance(c, MixedPrecision)]
    hi = learner(ds64, bs, copy.deepcopy(model).double(), keep + [Float64Smoothing()], opt_func, lr, **kw)
    fit_silent(hi, epochs)
    return low,rel_err(w(low).double(), flat([p.detach().double().cpu() for p in hi.model.parameters()]))

# -- mixed precision (BatchNorm-free model) ---------------------------------------------------------------------------
@needs_gpu
@pytest.mark.parametrize('amp_mode', ['fp16', 'bf16'])
def test_mixed_precision_equals_big_batch(amp_mode):
    "A scale that never overflows (fp16) or none (bf16): every window steps, weights equal one big batch's"
    ds = make_data(128, n_in=32)
    kw = dict(init_scale=2.**10) if amp_mode == 'fp16' else {}
    big,floor = fit_floor(ds, 32, MLP(32, seed=0), [MixedPrecision(amp_mode=amp_mode, **kw)], Adam, 1e-3, epochs=2)
    acc = fit_silent(learner(ds, 4, MLP(32, seed=0), [GradientAccumulation(n_step=8), MixedPrecision(amp_mode=amp_mode, **kw)], Adam, 1e-3), 2)
    ga = acc.gradient_accumulation
    assert ga.steps == big.train_iter == 8 and ga.n_step_cancelled == 0
    err = rel_err(w(acc), w(big))
    assert err <= floor_tol([floor]), (err, floor)   # low precision rounds each micro-batch, as the big batch once

@needs_gpu
def test_fp16_overflowing_windows_skipped_whole():
    """fp16 with a huge initial scale: the first windows overflow and are skipped whole (one scaler update each, so the
    scale halves once per window); compared like with like: the big batch over the windows that stepped"""
    # 2**30 overflows fp16 (max 65504) for any activation gradient above 2**-14 until ~14 + log2|g| halvings: with 48
    # windows some overflow and some step for |g| from 2**-13 to 2**33 (2**120 never came under the limit in 12 windows)
    n = 768
    ds = make_data(n, n_in=32)
    log = _ScaleLog()   # MixedPrecision drops the scaler at the end of fit
    acc = fit_silent(learner(ds, 4, MLP(32, seed=0), [GradientAccumulation(n_step=4), MixedPrecision(init_scale=2.**30), log], SGD, 0.1))
    ga = acc.gradient_accumulation
    n_win = n//16
    assert ga.steps + ga.n_step_cancelled == n_win and 0 < ga.n_step_cancelled < n_win
    assert log.scales[-1] == 2.**30 * 0.5**ga.n_step_cancelled   # growth_interval 2000: no growth yet
    skipped = ga.n_step_cancelled   # overflow only at the start, while the scale is too large
    keep = torch.arange(16*skipped, n)
    ref_ds = TensorDataset(*[t[keep] for t in ds.tensors])
    big,floor = fit_floor(ref_ds, 16, MLP(32, seed=0), [MixedPrecision(init_scale=2.**10)], SGD, 0.1)
    assert big.train_iter == ga.steps and rel_err(w(acc), w(big)) <= floor_tol([floor]), floor

@needs_gpu
def test_gradient_clip_once_per_window_fp16():
    "GradientClip after the scaler's unscale, on the window gradient: the same clipped step as one big batch"
    ds = make_data(64, n_in=32)
    cbs = lambda: [MixedPrecision(init_scale=2.**10), GradientClip(0.05)]
    big,floor = fit_floor(ds, 16, MLP(32, seed=0), cbs(), SGD, 0.5)
    acc = fit_silent(learner(ds, 4, MLP(32, seed=0), [GradientAccumulation(n_step=4)] + cbs(), SGD, 0.5))
    assert acc.gradient_accumulation.steps == 4 and rel_err(w(acc), w(big)) <= floor_tol([floor]), floor

# -- BatchNorm modes on a torchvision resnet --------------------------------------------------------------------------
def resnet_data(n=32, px=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, px, px, generator=g), torch.randint(0, 5, (n,), generator=g))

def resnet(channels_last=False):
    from torchvision.models import resnet18
    torch.manual_seed(0)
    m = resnet18(num_classes=5)
    return m.to(memory_format=torch.channels_last) if channels_last else m

def bn_learner(bs, cbs, channels_last=False, lr=0., n=32):
    ds = resnet_data(n)
    learn = learner(ds, bs, resnet(channels_last), cbs, SGD, lr, CrossEntropyLossFlat(), valid=resnet_data(8, seed=1))
    if channels_last: learn.dls.train.after_batch = lambda b: (b[0].contiguous(memory_format=torch.channels_last), *b[1:])
    return learn, ds

@pytest.mark.parametrize('channels_last', [False, True])
def bn1_stats_tol(big, channels_last=False)->float:
    "The tolerance on bn1's running statistics: float32's rounding on them (the GPU's kernels, TF32 or not) in the big fit `big` against the same fit in float64"
    hi,_ = bn_learner(16, [Float64Batches()], channels_last); hi.model.double(); fit_silent(hi)
    a,b = big.model.bn1,hi.model.bn1
    return floor_tol([rel_err(a.running_mean.cpu().double(), b.running_mean.cpu()), rel_err(a.running_var.cpu().double(), b.running_var.cpu())])

def test_pool_statistics_equal_big_batch(channels_last):
    "'pool' on resnet18 (lr 0, so every window sees the same weights): bn1's running stats are the big batch's"
    learn,ds = bn_learner(4, [GradientAccumulation(n_step=4), BatchNormAccumulation('pool')], channels_last)
    big,_ = bn_learner(16, [], channels_last)
    fit_silent(learn); fit_silent(big)
    tol = bn1_stats_tol(big, channels_last)
    for a,b in ((learn.model.bn1, big.model.bn1),):
        assert a.num_batches_tracked == b.num_batches_tracked == 2
        assert rel_err(a.running_mean.cpu(), b.running_mean.cpu()) <= tol
        assert rel_err(a.running_var.cpu(), b.running_var.cpu()) <= tol
    assert learn.model.bn1.momentum == 0.1 and not learn.model.bn1._forward_hooks

def test_momentum_mode_sets_and_restores():
    "'momentum': during fit every BatchNorm momentum is 1-(1-m)**(1/k); after fit it is m again"
    seen = []
    class Spy(Callback):
        order = BatchNormAccumulation.order+1
        def before_batch(self): seen.append(self.model.layer1[0].bn1.momentum)
    learn,_ = bn_learner(4, [GradientAccumulation(n_step=4), BatchNormAccumulation('momentum'), Spy()], lr=0.1)
    fit_silent(learn)
    assert seen and all(m == pytest.approx(accumulated_momentum(0.1, 4)) for m in seen) and learn.model.layer1[0].bn1.momentum == 0.1
    assert learn.model.bn1.num_batches_tracked == 8   # one update per micro-batch

def test_freeze_keeps_statistics():
    learn,_ = bn_learner(4, [GradientAccumulation(n_step=4), BatchNormAccumulation('freeze')], lr=0.1)
    before = learn.model.bn1.running_mean.clone()
    fit_silent(learn)
    assert torch.equal(learn.model.bn1.running_mean, before) and learn.gradient_accumulation.steps == 2
    assert torch.isfinite(w(learn)).all()

def test_groupnorm_conversion_trains_on_device():
    learn,_ = bn_learner(4, [GradientAccumulation(n_step=4), BatchNormAccumulation('groupnorm')], lr=0.1)
    ps = [id(p) for p in learn.model.parameters()]
    fit_silent(learn)
    assert isinstance(learn.model.bn1, nn.GroupNorm) and learn.model.bn1.weight.device.type == DEVICE.type
    assert [id(p) for p in learn.model.parameters()] == ps and torch.isfinite(w(learn)).all()

@pytest.mark.parametrize('channels_last', [False, True])
def test_renorm_conversion_eval_output_and_training(channels_last):
    "'renorm': eval output unchanged right after conversion; trains finite; BnFreeze still sees BatchNorm layers"
    learn,ds = bn_learner(4, [GradientAccumulation(n_step=4), BatchNormAccumulation('renorm')], channels_last, lr=0.)
    x = ds.tensors[0][:8].to(DEVICE)
    if channels_last: x = x.contiguous(memory_format=torch.channels_last)
    learn.model.eval()
    with torch.no_grad(): y0 = learn.model(x)
    fit_silent(learn)   # lr 0: weights unchanged; statistics move
    assert isinstance(learn.model.bn1, BatchRenorm) and isinstance(learn.model.bn1, nn.BatchNorm2d)
    learn.model.eval()
    with torch.no_grad(): assert torch.isfinite(learn.model(x)).all() and y0.shape == learn.model(x).shape

@needs_gpu
@pytest.mark.parametrize('dtype,channels_last', [(torch.float32, False), (torch.float32, True), (torch.float16, True), (torch.bfloat16, False)])
def test_fused_renorm_equals_reference(dtype, channels_last):
    """Batch Renorm in the input's precision (one reduction, then cuDNN's BatchNorm) against the fp32 unfused reference, same layer state:
    output, input/weight/bias gradients and running statistics, past the ramp so r and d clip"""
    torch.manual_seed(0)
    x0 = (torch.randn(8, 16, 6, 6, device=DEVICE)*3 + 1).to(dtype)
    if channels_last: x0 = x0.contiguous(memory_format=torch.channels_last)
    res = []
    for fused,f64 in ((True, False), (False, False), (False, True)):   # the last: the unfused layer in float64
        torch.manual_seed(1)
        bn = BatchRenorm(16, r_max=1.5, d_max=0.5, ramp=0).to(DEVICE)
        if f64: bn.double()
        with torch.no_grad(): bn.weight.uniform_(0.5, 1.5); bn.bias.uniform_(-1, 1); bn.running_var.fill_(0.3)
        bn.fused = fused
        x = (x0.double() if f64 else x0.clone()).requires_grad_()
        with torch.autocast('cuda', dtype=dtype, enabled=dtype != torch.float32 and not f64):
            y = bn(x)
        (y.double()*torch.linspace(-1, 1, y.numel(), device=DEVICE, dtype=torch.float64).view_as(y)).sum().backward()
        res.append([t.detach().double() for t in (y, x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var)])
    fused,ref,ref64 = res
    names = ('out', 'dx', 'dw', 'db', 'running_mean', 'running_var')
    # the unfused reference's own rounding against float64, and never below 16 ulps of the input's dtype
    tol = floor_tol([rel_err(a, b) for a,b in zip(ref, ref64)], dtype=dtype)
    for name,a,b in zip(names, fused, ref):
        assert rel_err(a, b) <= tol, (name, rel_err(a, b), tol)

@needs_gpu
def test_auto_micro_bs_fp16_replays_like_the_fixed_size():
    """micro_bs='auto' under fp16, out of memory above 8 items (simulated): the undone attempts leave no trace in the
    GradScaler (its scale after every step is the fixed micro_bs=8 run's) and the weights are that run's"""
    ds = make_data(256, n_in=32)
    def run(ga, loss):
        log = _ScaleLog()
        learn = fit_silent(learner(ds, 32, MLP(32, seed=0), [*ga, MixedPrecision(init_scale=2.**10), log], SGD, 0.1, loss_func=loss))
        return learn,log.scales
    auto,s_auto = run([GradientAccumulation(n_step=1), MicroBatching('auto', probe=False)], OutOfMemoryAbove(8))
    fixed,s_fixed = run([GradientAccumulation(n_step=1), MicroBatching(8)], F.mse_loss)
    assert auto.micro_batching.size == 8 and s_auto == s_fixed and len(s_auto) == 8
    assert torch.equal(w(auto), w(fixed))   # the same micro-batches of 8 in the same order: the same kernels, bitwise

# -- DDP over NCCL (world size 1 on one GPU) -----------------------------------------------------------------------------
@pytest.fixture
def process_group(monkeypatch):
    backend = 'nccl' if ON_GPU else 'gloo'
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1'); monkeypatch.setenv('MASTER_PORT', str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    yield backend
    dist.destroy_process_group()

def test_ddp_no_sync_one_allreduce_per_step(process_group):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ds = make_data(64, n_in=8)
    learn = learner(ds, 4, MLP(8, seed=0), [GradientAccumulation(n_step=4)])
    learn.model = DDP(learn.model, device_ids=[DEVICE.index or 0] if ON_GPU else None)
    counter = count_allreduces(learn.model)
    fit_silent(learn)
    big,floor = fit_floor(ds, 16, MLP(8, seed=0))
    assert counter.n_rounds == learn.gradient_accumulation.steps == 4
    assert rel_err(w(learn), w(big)) <= floor_tol([floor]), floor

def test_syncbatchnorm_pool_under_ddp(process_group):
    "SyncBatchNorm + DDP + 'pool': bn1's statistics equal one big batch's (world size 1)"
    from torch.nn.parallel import DistributedDataParallel as DDP
    learn,_ = bn_learner(4, [GradientAccumulation(n_step=4), BatchNormAccumulation('pool')])
    if ON_GPU: learn.model = nn.SyncBatchNorm.convert_sync_batchnorm(learn.model)
    learn.model = DDP(learn.model, device_ids=[DEVICE.index or 0] if ON_GPU else None)
    big,_ = bn_learner(16, [])
    fit_silent(learn); fit_silent(big)
    a,b = learn.model.module.bn1,big.model.bn1
    assert isinstance(a, nn.SyncBatchNorm) == ON_GPU and a.num_batches_tracked == 2
    tol = bn1_stats_tol(big)
    assert rel_err(a.running_mean.cpu(), b.running_mean.cpu()) <= tol and rel_err(a.running_var.cpu(), b.running_var.cpu()) <= tol

# -- torch.compile --------------------------------------------------------------------------------------------------------
def test_compile_default_is_exact():
    ds = make_data(64, n_in=8)
    acc = learner(ds, 4, torch.compile(MLP(8, seed=0)), [GradientAccumulation(n_step=4)])
    fit_silent(acc, 2); big,floor = fit_floor(ds, 16, MLP(8, seed=0), epochs=2)
    assert acc.gradient_accumulation.steps == 8 and rel_err(w(acc), w(big)) <= floor_tol([floor]), floor

@pytest.mark.parametrize('mode', ['reduce-overhead', 'max-autotune'])
def test_compile_with_cuda_graphs_is_refused_clearly(mode):
    ds = make_data(32, n_in=8)
    learn = learner(ds, 4, torch.compile(MLP(8, seed=0), mode=mode), [GradientAccumulation(n_step=4)])
    w0 = w(learn).clone()
    with pytest.raises(ValueError, match=r"CUDA graphs.*mode='default'"): fit_silent(learn)
    assert torch.equal(w(learn), w0) and not learn.lock.locked()

# -- the job's CUDA path ------------------------------------------------------------------------------------------------
@needs_gpu
def test_job_trains_on_the_gpu_and_records_it(tmp_path):
    "`accum-finetune --device cuda` on an image folder: metrics.json names the GPU it trained on"
    import json, subprocess, sys
    from test_cli import make_folder
    data,out = make_folder(tmp_path/'imgs'),tmp_path/'out'
    res = subprocess.run([sys.executable, '-m', 'accum_callback', '--data', str(data), '--arch', 'resnet18', '--weights', 'none',
                          '--micro-bs', '2', '--n-step', '4', '--epochs', '1', '--device', 'cuda', '--out', str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    m = json.loads((out/'metrics.json').read_text())
    assert m['device'].startswith('cuda:0 ') and m['optimizer_steps'] == 3
