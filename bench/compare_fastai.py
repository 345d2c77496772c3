"""Side by side: fastai's built-in `GradientAccumulation` and accum_callback's, against one large batch of the same samples.

    python bench/compare_fastai.py

Prints a markdown table; every figure is measured in this run (CPU, float32, a small MLP, fixed seeds)."""
import copy, warnings
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback
from fastai.callback.schedule import fit_one_cycle  # noqa: F401  (patches Learner)
from fastai.callback.training import GradientAccumulation as FastaiGA
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam

from accum_callback import GradientAccumulation

warnings.filterwarnings('ignore')

def data(n, seed=0, n_in=5, n_out=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    return TensorDataset(x, x @ torch.randn(n_in, n_out, generator=g) + 0.1*torch.randn(n, n_out, generator=g))

def mlp(n_in=5, n_out=3):
    torch.manual_seed(0); return nn.Sequential(nn.Linear(n_in, 16), nn.Tanh(), nn.Linear(16, n_out))

def learner(ds, bs, cbs=(), model=None, loss_func=F.mse_loss, opt_func=SGD, lr=0.1):
    dls = DataLoaders(DataLoader(ds, bs=bs), DataLoader(TensorDataset(*[t[:8] for t in ds.tensors]), bs=bs), device='cpu')
    return Learner(dls, model or mlp(), loss_func=loss_func, opt_func=opt_func, lr=lr, cbs=list(cbs))

def quiet(learn, n, meth='fit', **kw):
    with learn.no_bar(), learn.no_logging(): getattr(learn, meth)(n, **kw)
    return learn

class FirstStepGrad(Callback):
    "Records the gradient the optimizer is about to apply, and the weights it starts from, at every step"
    order = 50
    def before_fit(self): self.grads,self.ws = [],[]
    def before_step(self):
        self.grads.append(torch.cat([p.grad.reshape(-1).clone() for p in self.model.parameters()]))
        self.ws.append(copy.deepcopy(self.model))

def big_grad(model, xb, yb, loss_func=F.mse_loss):
    m = copy.deepcopy(model); m.zero_grad(); loss_func(m(xb), yb).backward()
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])

def rel(a, b): return ((a-b).norm()/b.norm()).item()
def pct(e): return f'{100*e:.1f}%' if e >= 1e-3 else f'{e:.1e}'

def first_step_error(cb, bs, n, window, loss_func=F.mse_loss, ds=None):
    ds = ds or data(n); spy = FirstStepGrad()
    learn = learner(ds, bs, [cb, spy], loss_func=loss_func); quiet(learn, 1)
    x, y = ds.tensors
    return rel(spy.grads[0], big_grad(spy.ws[0], x[:window], y[:window], loss_func))

def uneven(make):
    "micro-batch 5, 12-sample target: the window closes at 15 samples; and 6 with a 16-sample target (18)"
    return first_step_error(make(12), 5, 30, 15), first_step_error(make(16), 6, 36, 18)

def leak(make_cb):
    "a partial window at the end of fit 1 (36 samples, micro-batch 5, windows of 3): fit 2's first step"
    ds = data(36); learn = learner(ds, 5, [make_cb()]); quiet(learn, 1)
    spy = FirstStepGrad(); learn.add_cb(spy); quiet(learn, 1)
    x, y = ds.tensors
    return rel(spy.grads[0], big_grad(spy.ws[0], x[:15], y[:15]))

def token():
    "padded token-mean cross-entropy, micro-batch 4, windows of 3 micro-batches"
    g = torch.Generator().manual_seed(1); n, T, V = 24, 8, 5
    x, y = torch.randn(n, T, 4, generator=g), torch.randint(0, V, (n, T), generator=g)
    lens = torch.randint(1, T+1, (n,), generator=g); y[torch.arange(T)[None] >= lens[:, None]] = -100
    y[:4, 1:] = -100
    lf = lambda p, t: F.cross_entropy(p.reshape(-1, V), t.reshape(-1), ignore_index=-100)
    ds = TensorDataset(x, y); out = []
    for cb in (FastaiGA(12), GradientAccumulation(n_step=3, n_items=lambda l: (l.yb[0] != -100).sum())):
        spy = FirstStepGrad(); learn = learner(ds, 4, [cb, spy], model=mlp(4, V), loss_func=lf); quiet(learn, 1)
        out.append(rel(spy.grads[0], big_grad(spy.ws[0], x[:12], y[:12], lf)))
    return out

def nan():
    "one NaN sample in micro-batch 2 of 12"
    out = []
    for cb in (FastaiGA(16), GradientAccumulation(n_step=4)):
        ds = data(48); ds.tensors[0][5, 0] = float('nan')
        learn = learner(ds, 4, [cb]); quiet(learn, 1)
        out.append(bool(torch.isfinite(torch.cat([p.reshape(-1) for p in learn.model.parameters()])).all()))
    return out

def one_cycle():
    "fit_one_cycle(2), Adam, micro-batch 4 x 8 against batch 32: relative weight difference at the end"
    ds = data(256, seed=3); w = lambda l: torch.cat([p.detach().reshape(-1) for p in l.model.parameters()])
    ref = quiet(learner(ds, 32, opt_func=Adam, lr=3e-3), 2, 'fit_one_cycle')
    return [rel(w(quiet(learner(ds, 4, [cb], opt_func=Adam, lr=3e-3), 2, 'fit_one_cycle')), w(ref))
            for cb in (FastaiGA(32), GradientAccumulation(n_step=8))]

def main():
    rows = []
    fa, ours = uneven(lambda t: FastaiGA(t)), uneven(lambda t: GradientAccumulation(target_bs=t))
    rows.append(('gradient error, micro-batch 5, target 12', pct(fa[0]), pct(ours[0])))
    rows.append(('gradient error, micro-batch 6, target 16', pct(fa[1]), pct(ours[1])))
    fa_leak, our_leak = leak(lambda: FastaiGA(15)), leak(lambda: GradientAccumulation(n_step=3))
    rows.append(("next fit's first step after a partial window", pct(fa_leak), pct(our_leak)))
    t = token(); rows.append(('padded token-mean loss, first step', pct(t[0]), pct(t[1])))
    n = nan(); rows.append(('weights finite after one NaN micro-batch', 'yes' if n[0] else 'no', 'yes' if n[1] else 'no'))
    oc = one_cycle(); rows.append(('fit_one_cycle(2) 4x8 vs batch 32, weights', pct(oc[0]), pct(oc[1])))
    print('| against one large batch of the same samples | fastai `GradientAccumulation` | accum_callback |')
    print('|---|---|---|')
    for r in rows: print('| ' + ' | '.join(r) + ' |')
    print(f'\ntorch {torch.__version__}, float32, CPU; relative L2 error of the applied gradient (or of the final weights)')

if __name__ == '__main__': main()
