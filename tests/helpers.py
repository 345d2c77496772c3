"Small learners and a spy callback that checks every optimizer step against the one-large-batch gradient"
import copy
import pytest
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.callback.core import Callback
from fastai.learner import Learner
from fastai.optimizer import SGD

from accum_callback import GradientAccumulation
from accum_callback.testing import regression_data

# FSDP2's `fully_shard` is public from torch 2.6; the oldest tier of the version matrix has 2.4 (setup.cfg's lower bound)
import torch.distributed.fsdp as _fsdp_pkg
HAS_FSDP2 = hasattr(_fsdp_pkg, 'fully_shard')
needs_fsdp2 = pytest.mark.skipif(not HAS_FSDP2, reason=f'FSDP2 (torch.distributed.fsdp.fully_shard) is not in torch {torch.__version__}')
DISTRIBUTED_KINDS = ('ddp', 'fsdp') if HAS_FSDP2 else ('ddp',)   # what a test on 2 gloo processes runs here

make_data = regression_data   # `n` items of `n_in` features and a linear target (or `classify`: labels), float32

def make_dls(ds, bs, valid=None, shuffle=False, drop_last=False):
    valid = valid if valid is not None else TensorDataset(*[t[:8] for t in ds.tensors])
    return DataLoaders(DataLoader(ds, bs=bs, shuffle=shuffle, drop_last=drop_last),
                       DataLoader(valid, bs=bs), device='cpu')

class MLP(nn.Module):
    def __init__(self, n_in=5, n_hidden=16, n_out=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.l1,self.l2 = nn.Linear(n_in, n_hidden),nn.Linear(n_hidden, n_out)
    def forward(self, x): return self.l2(torch.tanh(self.l1(x)))

class Float64Smoothing(Callback):
    "Let the Recorder's loss smoothing take float64 losses (it starts from a float32 zero)"
    order = 51   # after `Recorder.before_fit` resets its smoother
    def before_fit(self): self.learn.recorder.smooth_loss.val = self.learn.recorder.smooth_loss.val.double()

def make_learner(ds, bs, cbs=None, loss_func=F.mse_loss, opt_func=SGD, lr=0.1, seed=0, model=None, dtype=None, **kw):
    """A Learner on `ds` (an MLP unless `model`). `dtype=torch.float64` casts the data and model: the exactness property
    tests use it, so that a 1e-6 tolerance measures the accumulation, not float32 rounding (which reached 1.03e-6 on a
    window whose gradient nearly cancels)"""
    if dtype is not None: ds = TensorDataset(*[t.to(dtype) if t.is_floating_point() else t for t in ds.tensors])
    n_in,n_out = ds.tensors[0].shape[1], (ds.tensors[1].shape[1] if ds.tensors[1].ndim > 1 else 3)
    model = model if model is not None else MLP(n_in=n_in, n_out=n_out, seed=seed)
    if dtype is not None: model = model.to(dtype)
    if dtype == torch.float64: cbs = [*(cbs if isinstance(cbs, (list, tuple)) else [cbs] if cbs is not None else []), Float64Smoothing()]
    learn = Learner(make_dls(ds, bs, **kw), model, loss_func=loss_func, opt_func=opt_func, lr=lr, cbs=cbs)
    learn.recorder.train_metrics = False
    return learn

def flat(ts): return torch.cat([t.reshape(-1) for t in ts])
def rel_err(a, b): return ((a-b).norm()/b.norm().clamp_min(1e-30)).item()

class WindowSpy(Callback):
    """Placed right after `GradientAccumulation`: at every optimizer step, recompute the gradient of the mean loss over
    all the window's samples in one batch (with the weights the step starts from) and record the relative error"""
    order = GradientAccumulation.order+1
    run_valid = False
    def __init__(self, big_loss=None): self.big_loss = big_loss
    def before_fit(self):
        self.buf,self.errs,self.windows = [],[],[]
        self.learn.gradient_accumulation.on_window_close(self.closed)
    def after_fit(self): self.learn.gradient_accumulation.remove_window_listener(self.closed)
    def closed(self, stepped): self.buf = []
    def after_backward(self):
        if self.learn.gradient_accumulation.window.counted: self.buf.append((self.xb, self.yb))   # not a cancelled backward
    def before_step(self):
        xb = [torch.cat([b[0][i] for b in self.buf]) for i in range(len(self.xb))]
        yb = [torch.cat([b[1][i] for b in self.buf]) for i in range(len(self.yb))]
        m = copy.deepcopy(self.model); m.zero_grad()
        loss = (self.big_loss or self.loss_func)(m(*xb), *yb); loss.backward()
        ref = flat([p.grad for p in m.parameters()])
        got = flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()])
        self.errs.append(rel_err(got, ref)); self.windows.append(len(yb[0]))

def fit_quiet(learn, n_epoch, meth='fit', **kw):
    "Fit without progress bars or printed tables (fastai's `no_bar` / `no_logging`)"
    with learn.no_bar(), learn.no_logging(): getattr(learn, meth)(n_epoch, **kw)
    return learn

def fit_silent(learn, n_epoch=1, meth='fit', **kw):
    "`fit_quiet` with warnings silenced too (a test that checks a warning uses `fit_quiet` in `pytest.warns`)"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('ignore'); fit_quiet(learn, n_epoch, meth, **kw)
    return learn

def expected_windows(n, bs, n_epoch, n_step=None, target_bs=None, partial='step'):
    "Sizes (samples) of the windows that should be stepped, written from the contract alone"
    batches = [bs]*(n//bs) + ([n % bs] if n % bs else [])
    out,cur,k = [],0,0
    for e in range(n_epoch):
        for i,b in enumerate(batches):
            cur += b; k += 1
            full = k >= n_step if n_step else cur >= target_bs
            last = i == len(batches)-1
            if full or (last and partial == 'step'): out.append(cur); cur,k = 0,0
            elif last and (partial == 'drop' or e == n_epoch-1): cur,k = 0,0
    return out

def grads_clean(model): return all(p.grad is None or not p.grad.abs().sum() for p in model.parameters())

class StepCounter(Callback):
    "Counts the optimizer steps that really ran, at the optimizer itself (wrapped at every `before_fit`)"
    order = -100
    def __init__(self): self.n = 0
    def before_fit(self):
        opt = self.learn.opt
        if opt is None or getattr(opt.step, '_counted', False): return
        orig = opt.step
        def step(*a, **k): self.n += 1; return orig(*a, **k)
        step._counted = True
        opt.step = step

def lm_learner_factory():
    """`make(cbs)`: a fastai AWD_LSTM language model (its hidden state carries one row per batch row into the next batch) with
    fastai's rnn callbacks (ModelResetter, RNNCallback, RNNRegularizer with AR/TAR), dropout off"""
    from fastai.callback.rnn import rnn_cbs
    from fastai.losses import CrossEntropyLossFlat
    from fastai.text.models.awdlstm import AWD_LSTM
    from fastai.text.models.core import get_language_model
    from fastai.text.data import LMDataLoader
    from fastai.data.core import DataLoaders
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(2, 30, (int(n),), generator=g) for n in torch.randint(20, 60, (24,), generator=g)]
    # weight_p 1e-12, not 0: fastai 2.8's WeightDropout registers torch 2.14's dropout output for p=0 (the Parameter
    # itself) as a parameter, and its reset() then fails; at 1e-12 no weight is ever dropped
    cfg = dict(emb_sz=8, n_hid=12, n_layers=2, pad_token=1, bidir=False, output_p=0., hidden_p=0., input_p=0.,
               embed_p=0., weight_p=1e-12, tie_weights=True, out_bias=True)
    def make(cbs=()):
        torch.manual_seed(0)
        model = get_language_model(AWD_LSTM, 30, config=dict(cfg), drop_mult=1.)
        dls = DataLoaders(LMDataLoader(texts, bs=8, seq_len=6), LMDataLoader(texts[:8], bs=8, seq_len=6), device='cpu')
        return Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=0.5, cbs=rnn_cbs(2., 1.) + list(cbs))
    return make

def accumulation(micro_bs=None, probe=True, **window)->list:
    """`GradientAccumulation(**window)`, and beside it `MicroBatching(micro_bs, probe)` where `micro_bs` is given (one
    step a loader batch unless `window` says otherwise): the test tables' one spelling for both"""
    from accum_callback import MicroBatching
    if micro_bs is None: return [GradientAccumulation(**window)]
    if not window.keys() & {'n_step', 'target_bs'}: window = dict(window, n_step=1)
    return [GradientAccumulation(**window), MicroBatching(micro_bs, probe)]
