"""What BatchNormAccumulation('window') costs (issue 73): time per epoch of 'window' (exact), 'window-approx' and 'pool'
against plain accumulation on the same cut (each loader batch of b*k cut by `MicroBatching(b)`, `GradientAccumulation(
n_step=1)`), measured side by side in rounds of one run, on fastai's collab-nn MLP (2 BatchNorm1d layers) and a small
conv net (3 BatchNorm2d). Prints a markdown table of ratios (median over rounds and a robust spread).

    python bench/bn_window_cost.py                  # CPU, small sizes
    python bench/bn_window_cost.py --device cuda    # the same on a GPU (larger batches)
"""
import argparse, sys, time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from common import machine, rounds, summary

MODES = ('window', 'window-approx', 'pool')

def mlp(n_users=943, n_items=1682, seed=0):
    "fastai's collab-nn model (`EmbeddingNN`: embeddings into a TabularModel with BatchNorm1d, layers 100, 50)"
    from fastai.collab import EmbeddingNN
    torch.manual_seed(seed)
    return EmbeddingNN([(n_users, 74), (n_items, 102)], layers=[100, 50], y_range=(0, 5.5))

def conv(seed=0):
    torch.manual_seed(seed)
    def blk(ni, nf, s): return nn.Sequential(nn.Conv2d(ni, nf, 3, s, 1, bias=False), nn.BatchNorm2d(nf), nn.ReLU())
    return nn.Sequential(blk(3, 16, 1), blk(16, 32, 2), blk(32, 64, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))

def data(task, n, px):
    g = torch.Generator().manual_seed(0)
    if task == 'collab':
        x = torch.stack([torch.randint(0, 943, (n,), generator=g), torch.randint(0, 1682, (n,), generator=g)], 1)
        return TensorDataset(x, torch.rand(n, 1, generator=g)*5),F.mse_loss
    x,y = torch.randn(n, 3, px, px, generator=g),torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(x, y),F.cross_entropy

class Timer:
    "Training time of the epoch (no validation), synchronised on a GPU"
    def __new__(cls, device):
        from fastai.callback.core import Callback
        class _T(Callback):
            order = 100
            def _sync(self):
                if device.startswith('cuda'): torch.cuda.synchronize()
            def before_train(self): self._sync(); self.t0 = time.perf_counter()
            def after_train(self): self._sync(); self.secs = time.perf_counter()-self.t0
        return _T()

def learner(task, mode, b, k, n, px, device):
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import SGD
    from accum_callback import BatchNormAccumulation, GradientAccumulation, MicroBatching
    ds,lf = data(task, n, px)
    valid = TensorDataset(*[t[:b] for t in ds.tensors])
    dls = DataLoaders(DataLoader(ds, bs=b*k), DataLoader(valid, bs=b), device=device)
    model = (mlp() if task == 'collab' else conv()).to(device)
    timer = Timer(device)
    cbs = [GradientAccumulation(n_step=1), MicroBatching(b), timer] + ([BatchNormAccumulation(mode)] if mode else [])
    learn = Learner(dls, model, loss_func=lf, opt_func=SGD, lr=1e-3, cbs=cbs)
    learn.bench_timer = timer
    return learn

def fit_time(learn):
    import warnings
    with warnings.catch_warnings(), learn.no_bar(), learn.no_logging(): warnings.simplefilter('ignore'); learn.fit(1)
    return learn.bench_timer.secs

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--repeats', type=int, default=3)
    a = ap.parse_args(argv)
    cuda = a.device.startswith('cuda')
    if not cuda: torch.set_num_threads(1)
    sizes = dict(collab=dict(b=16, k=4, n=(64*200 if cuda else 64*40), px=0),
                 conv=dict(b=(32 if cuda else 8), k=4, n=(32*4*50 if cuda else 8*4*10), px=(32 if cuda else 16)))
    print(f"- machine: {machine()}\n- command: `python bench/bn_window_cost.py --device {a.device} "
          f"--repeats {a.repeats}`\n")
    print("| model | measure | ratio (median ± spread over rounds) |\n|---|---|---|")
    for task,sz in sizes.items():
        ls = {m or 'plain': learner(task, m, sz['b'], sz['k'], sz['n'], sz['px'], a.device) for m in (None, *MODES)}
        t,errs = rounds({n: partial(fit_time, l) for n,l in ls.items()}, a.repeats)
        label = f"{task} ({'collab-nn MLP' if task == 'collab' else 'conv net'}), micro-batch {sz['b']} x {sz['k']}"
        for m in MODES:
            if m in errs: print(f"| {label} | `{m}` / plain accumulation | {errs[m]} |"); continue
            r,noise = summary([x/y for x,y in zip(t[m], t['plain'])])
            what = f"time/epoch `BatchNormAccumulation('{m}')` / plain accumulation"
            print(f"| {label} | {what} | {r:.2f} ± {noise:.2f} |")

if __name__ == '__main__': main()
