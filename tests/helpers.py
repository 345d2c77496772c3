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

class SmoothingInLossDtype(Callback):
    "The Recorder's loss smoothing in the loss's dtype (float64 from a float64 loss, float32 from fastai's flat losses)"
    order = 49   # before the Recorder's `after_batch`
    def after_batch(self):
        sl = self.learn.recorder.smooth_loss
        sl.val = sl.val.to(self.learn.loss.dtype)

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

# -- float32 tolerances from float32's measured rounding -----------------------------------------------------------
# A float32 result equals its float64 reference only to float32's rounding on that computation, which depends on the
# CPU's kernels (AVX-512, AVX2, scalar) and the summation order: a tolerance is that rounding, measured in the test on
# the same computation (the large batch in float32 against float64), times this factor; never a constant one CPU
# printed.
F32_SAFETY = 16   # an accumulation of k micro-batches rounds k partial sums more than the one large batch does

def as64(x):
    "Floating tensors (in tuples/lists) as float64, the rest as they are"
    if isinstance(x, (tuple, list)): return type(x)(as64(o) for o in x)
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

def floor_tol(floors, dtype=torch.float32, safety=F32_SAFETY)->float:
    """The tolerance for results of `dtype` whose float32 large-batch computations were `floors` (relative errors
    against float64) away from float64's: `safety` times the largest, and never below `safety` ulps of `dtype` (a computation
    float32 happens to round exactly)"""
    return safety*max([*floors, torch.finfo(dtype).eps])

def f32_floor(fn, *args)->float:
    """Float32's rounding on `fn(*args)` (a tensor, or tensors): the relative error of the float32 result against the
    same computation in float64 (`args` cast by `as64`; modules among them copied and cast)"""
    def cast(a): return copy.deepcopy(a).double() if isinstance(a, nn.Module) else as64(a)
    got,want = fn(*args),fn(*[cast(a) for a in args])
    got,want = (flat(o) if isinstance(o, (tuple, list)) else o.reshape(-1) for o in (got, want))
    return rel_err(got.double(), want)

def _floats(o)->list:
    "The floating tensors in a model's output (a tensor, or dicts/tuples/lists of them), in order"
    if isinstance(o, dict): o = list(o.values())
    if isinstance(o, (tuple, list)): return [t for x in o for t in _floats(x)]
    return [o.reshape(-1)] if isinstance(o, torch.Tensor) and o.is_floating_point() else []

def plain_loss(learn, model, xb, yb): return learn.loss_func(model(*xb), *yb)

def forward_floor(learn, loss=plain_loss, state64=None)->float:
    """Float32's rounding on inference: the model (in eval mode, no gradient) on one validation batch, its outputs and
    `loss(learn, model, xb, yb)`, float32 against the same batch through a float64 copy (`state64(copy)` casts a state
    it carries outside its parameters); the largest relative error. `floor_tol` of it bounds two float32 inference
    runs that group the same items otherwise (cut batches, another summation)"""
    from accum_callback.micro import copy_module
    n = learn.dls.n_inp; b = learn.dls.valid.one_batch(); xb,yb = tuple(b[:n]),tuple(b[n:])
    def copies():   # fresh copies for each pass: a stateful model's state moves on at every forward
        m32,m64 = copy_module(learn.model),copy_module(learn.model, computed=lambda t: t.detach().double()).double()
        if state64 is not None: state64(m64)
        return m32.eval(),m64.eval()
    errs,rng = [],torch.get_rng_state()
    with torch.no_grad():
        for fn in (lambda m, x, y: _floats(m(*x)), lambda m, x, y: [loss(learn, m, x, y).reshape(-1)]):
            m32,m64 = copies()
            torch.set_rng_state(rng); a = fn(m32, xb, yb)
            torch.set_rng_state(rng); b64 = fn(m64, as64(xb), as64(yb))
            errs.append(rel_err(flat(a).double(), flat(b64).double()))
    torch.set_rng_state(rng)
    return max(errs)

class Float64Batches(Callback):
    """Every batch cast to float64 before any other callback sees it (the Learner's data stays float32), and the recorded
    loss (fastai's flattened losses compute in float32 whatever the input) float64 for the smoothing"""
    order = -100
    def before_batch(self): self.learn.xb,self.learn.yb = as64(self.xb),as64(self.yb)
    def after_loss(self): self.learn.loss = self.loss.double()

def as_float64(learn):
    "`learn` made a float64 run in place: its model cast, its batches cast (`Float64Batches`), float64 loss smoothing"
    learn.model.double(); learn.add_cbs([Float64Batches(), Float64Smoothing()])
    return learn

def weights_of(learn): return flat([p.detach() for p in learn.model.parameters()])

def fit_floor(make, fit, of=weights_of)->tuple:
    """(the float32 Learner `make(None)` fitted by `fit`, float32's rounding on that whole fit): the relative error of
    `of(learner)` (its weights; or a dict of tensors: the largest) against `make(torch.float64)`'s, the same fit in
    float64; `floor_tol` of it is the tolerance for another float32 computation of that fit (e.g. accumulated)"""
    low,high = make(None),make(torch.float64)
    fit(low); fit(high)
    a,b = of(low),of(high)
    if not isinstance(a, dict): a,b = {0: a},{0: b}
    return low,max(rel_err(a[k].double(), b[k].double()) for k in a)

class WindowSpy(Callback):
    """Placed right after `GradientAccumulation`: at every optimizer step, recompute the gradient of the mean loss over
    all the window's samples in one batch (with the weights the step starts from) and record the relative error. A
    float32 model's reference is that gradient in float64 (`errs`), and float32's own large batch's error against it is
    recorded too (`floors`): `tol` is the tolerance they give (`floor_tol`)"""
    order = GradientAccumulation.order+1
    run_valid = False
    def __init__(self, big_loss=None): self.big_loss = big_loss
    def before_fit(self):
        self.buf,self.errs,self.windows,self.floors = [],[],[],[]
        self.learn.gradient_accumulation.on_window_close(self.closed)
    def after_fit(self): self.learn.gradient_accumulation.remove_window_listener(self.closed)
    def closed(self, stepped): self.buf = []
    def after_backward(self):
        if self.learn.gradient_accumulation.window.counted: self.buf.append((self.xb, self.yb))   # not a cancelled backward
    def before_step(self):
        xb = [torch.cat([b[0][i] for b in self.buf]) for i in range(len(self.xb))]
        yb = [torch.cat([b[1][i] for b in self.buf]) for i in range(len(self.yb))]
        rng = torch.get_rng_state()
        ref = self._big_grad(self.model, xb, yb)
        got = flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()])
        if got.dtype == torch.float32:
            torch.set_rng_state(rng)   # the same dropout masks
            ref64 = self._big_grad(copy.deepcopy(self.model).double(), as64(xb), as64(yb))
            self.floors.append(rel_err(ref.double(), ref64)); ref,got = ref64,got.double()
        self.errs.append(rel_err(got, ref)); self.windows.append(len(yb[0]))
    def _big_grad(self, model, xb, yb):
        m = copy.deepcopy(model); m.zero_grad()
        loss = (self.big_loss or self.loss_func)(m(*xb), *yb); loss.backward()
        return flat([p.grad for p in m.parameters()])
    @property
    def tol(self)->float: return floor_tol(self.floors)

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
