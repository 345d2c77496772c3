"""`lr_find` with accumulation against the plain Learner whose batch is the window: the suggestion (fastai's valley)
of micro-batches b x k (GradientAccumulation(n_step=k), and MicroBatching(b) under one loader batch of b*k) over the
plain Learner's at bs b*k, over seeds and two models (an MLP regression and a small conv net classifying random
images), float32, shuffled loaders seeded alike; before training and after a fit of 2 epochs (fine_tune's case).
Ratios measured side by side in one run; printed as measured (docs/).

    python bench/lr_find_bench.py [--seeds 5] [--b 4] [--k 8]"""
import argparse, math, statistics, sys, warnings
from pathlib import Path

import torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1]/'tests'))

def data(kind, seed, n=512):
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(seed)
    if kind == 'mlp':
        x = torch.randn(n, 8, generator=g); w = torch.randn(8, 3, generator=g)
        return TensorDataset(x, x @ w + 0.3*torch.randn(n, 3, generator=g))
    x = torch.randn(n, 3, 12, 12, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + (x[:, 1].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)

def model(kind, seed):
    torch.manual_seed(seed)
    if kind == 'mlp': return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 3))

def suggestion(kind, seed, bs, cbs, after):
    from fastai.learner import Learner
    from fastai.optimizer import Adam
    from fastai.torch_core import set_seed
    import fastai.callback.schedule  # noqa: F401
    from helpers import make_dls
    set_seed(seed)
    learn = Learner(make_dls(data(kind, seed), bs, shuffle=True), model(kind, seed),
                    loss_func=F.mse_loss if kind == 'mlp' else nn.CrossEntropyLoss(), opt_func=Adam, lr=1e-3, cbs=cbs)
    with learn.no_logging(), learn.no_bar(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if after: learn.fit(2, 1e-3)
        return learn.lr_find(show_plot=False).valley

def main():
    from accum_callback import GradientAccumulation, MicroBatching
    a = argparse.ArgumentParser()
    a.add_argument('--seeds', type=int, default=5); a.add_argument('--b', type=int, default=4)
    a.add_argument('--k', type=int, default=8); args = a.parse_args()
    torch.set_num_threads(1)
    b,k = args.b,args.k
    print(f"suggestion of micro-batches {b} x {k} over the plain Learner's at bs {b*k} (valley), {args.seeds} seeds")
    for kind in ('mlp', 'conv'):
        for after in (False, True):
            r = {'n_step': [], 'micro_bs': []}
            for seed in range(args.seeds):
                ref = suggestion(kind, seed, b*k, [], after)
                r['n_step'].append(suggestion(kind, seed, b, [GradientAccumulation(n_step=k)], after)/ref)
                cut = [GradientAccumulation(n_step=1), MicroBatching(b)]
                r['micro_bs'].append(suggestion(kind, seed, b*k, cut, after)/ref)
            for cut,v in r.items():
                geo = math.exp(statistics.mean(math.log(x) for x in v))
                print(f"{kind:5} {'after 2 epochs' if after else 'untrained':14} {cut:8}: ratio geo-mean {geo:.3f}, "
                      f"min {min(v):.3f}, max {max(v):.3f}")

if __name__ == '__main__': main()
