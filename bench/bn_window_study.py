"""Which BatchNorm mode trains as the large batch (issue 73): valid loss of plain fastai at the large batch against
micro-batches with every `BatchNormAccumulation` mode ('none': plain accumulation, ghost batch norm), 3 seeds, on:

- `collab`: fastai's collab tutorial with `use_nn=True` on synthetic MovieLens-100k-shaped ratings (943 users, 1682
  items, low-rank ratings 1-5 with noise, no download): `collab_learner(dls, use_nn=True, y_range=(0, 5.5),
  layers=[100, 50])`, `fit_one_cycle(E, 5e-3, wd=0.1)`, valid MSE;
- `tabular`: `tabular_learner(layers=[200, 100])` on synthetic census-like data (categorical and continuous columns,
  a nonlinear binary target), `fit_one_cycle(E, 1e-2)`, valid error rate;
- `conv`: a small conv net from scratch (3 conv + BatchNorm2d blocks) on sklearn's digits (8x8, bundled),
  `fit_one_cycle(E, 1e-2)`, valid error rate.

The large batch is plain fastai at `bs` (64); the micro-batch runs load the same batches and cut each into `bs/micro`
pieces (`MicroBatching(micro)`, `GradientAccumulation(n_step=1)`): every step the same samples. Prints a markdown table
(mean over seeds, its ratio to the large batch). `--subsample F` trains each epoch on a fraction F of the training set
(the same fraction for every contender), to keep CPU runs short; the docs say which was used.

    python bench/bn_window_study.py --task collab --seeds 3
"""
import argparse, math, time, warnings
import numpy as np

CONTENDERS = ('large', 'none', 'pool', 'momentum', 'freeze', 'groupnorm', 'renorm', 'window', 'window-approx')

def ratings(n_users=943, n_items=1682, n=100_000, rank=8, noise=0.6, seed=0):
    "Low-rank ratings shaped like MovieLens-100k: user and item factors and biases, clipped and rounded to 1..5"
    import pandas as pd
    rng = np.random.default_rng(seed)
    U,V = rng.normal(0, 1, (n_users, rank)),rng.normal(0, 1, (n_items, rank))
    bu,bi = rng.normal(0, 0.4, n_users),rng.normal(0, 0.6, n_items)
    pop = rng.zipf(1.6, n_items).astype(float); pop /= pop.sum()   # a few items rated often, as in MovieLens
    u,i = rng.integers(0, n_users, n),rng.choice(n_items, n, p=pop)
    r = 3.5 + bu[u] + bi[i] + (U[u]*V[i]).sum(1)/math.sqrt(rank)*0.9 + rng.normal(0, noise, n)
    return pd.DataFrame(dict(user=u, item=i, rating=np.clip(np.round(r), 1, 5).astype(np.float32)))

def census(n=20_000, seed=0):
    "Census-like table: 4 categorical and 4 continuous columns, a nonlinear binary target"
    import pandas as pd
    rng = np.random.default_rng(seed)
    cats = {f'c{k}': rng.integers(0, m, n) for k,m in enumerate((7, 16, 5, 40))}
    conts = {f'x{k}': rng.normal(0, 1, n)*(k+1) + 10*k for k in range(4)}
    w = rng.normal(0, 1, 40)
    logit = (np.sin(conts['x0']) + 0.3*conts['x1']*(cats['c0'] % 2) - 0.2*(conts['x2']-20)**2/9 + w[cats['c3']]
             + 0.5*(cats['c1'] > 8) + rng.normal(0, 0.5, n))
    df = pd.DataFrame({**cats, **conts}); df['y'] = (logit > np.median(logit)).astype(int)
    return df

def learner(task, mode, bs, micro, seed, subsample):
    import torch
    from fastai.basics import set_seed
    from accum_callback import BatchNormAccumulation, GradientAccumulation, MicroBatching
    set_seed(seed, reproducible=True)
    cbs = [] if mode == 'large' else [GradientAccumulation(n_step=1), MicroBatching(micro)]
    if mode not in ('large', 'none'): cbs.append(BatchNormAccumulation(mode))
    if task == 'collab':
        from fastai.collab import CollabDataLoaders, collab_learner
        dls = CollabDataLoaders.from_df(ratings(seed=0), bs=bs, seed=seed, valid_pct=0.1)
        learn = collab_learner(dls, use_nn=True, y_range=(0, 5.5), layers=[100, 50], cbs=cbs)
    elif task == 'tabular':
        from fastai.tabular.all import tabular_learner, error_rate
        dls = _tab_dls(census(), bs, seed)
        learn = tabular_learner(dls, layers=[200, 100], metrics=error_rate, cbs=cbs)
    else:
        learn = _conv_learner(bs, seed, cbs)
    if subsample < 1: learn.add_cb(Subsample(subsample))
    return learn

def _tab_dls(df, bs, seed):
    from fastai.tabular.all import TabularPandas, Categorify, Normalize, RandomSplitter, CategoryBlock
    splits = RandomSplitter(0.2, seed=seed)(range(len(df)))
    to = TabularPandas(df, procs=[Categorify, Normalize], cat_names=['c0', 'c1', 'c2', 'c3'],
                       cont_names=['x0', 'x1', 'x2', 'x3'], y_names='y', y_block=CategoryBlock(), splits=splits)
    return to.dataloaders(bs=bs)

def _conv_learner(bs, seed, cbs):
    import torch, torch.nn as nn
    from sklearn.datasets import load_digits
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.metrics import error_rate
    from fastai.losses import CrossEntropyLossFlat
    from torch.utils.data import TensorDataset
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None]/16.; y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(seed); idx = torch.randperm(len(x), generator=g)
    tr,va = idx[:1400],idx[1400:]
    dls = DataLoaders(DataLoader(TensorDataset(x[tr], y[tr]), bs=bs, shuffle=True, drop_last=True),
                      DataLoader(TensorDataset(x[va], y[va]), bs=256), device='cpu')
    def blk(ni, nf, s): return nn.Sequential(nn.Conv2d(ni, nf, 3, s, 1, bias=False), nn.BatchNorm2d(nf), nn.ReLU())
    torch.manual_seed(seed)
    model = nn.Sequential(blk(1, 16, 1), blk(16, 32, 2), blk(32, 64, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(64, 10))
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=error_rate, cbs=cbs)

def Subsample(frac):
    "Each training epoch stops after a fraction `frac` of its loader batches (the same for every contender)"
    from fastai.callback.core import Callback, CancelTrainException
    class _Sub(Callback):
        order = -20   # before the accumulation: a cancelled epoch leaves no window open
        def before_train(self): self.n,self.stop = 0,max(1, int(len(self.dl)*frac))
        def before_batch(self):
            if not self.training: return
            mb = getattr(self.learn, 'micro_batching', None)
            p = mb.piece if mb is not None else None
            if p is None or p.start == 0: self.n += 1
            if self.n > self.stop: raise CancelTrainException()
    return _Sub()

PARAMS = dict(collab=dict(lr=5e-3, wd=0.1, metric='valid MSE'),
              tabular=dict(lr=1e-2, wd=None, metric='valid error rate'),
              conv=dict(lr=1e-2, wd=None, metric='valid error rate'))

def run(task, mode, bs, micro, seed, epochs, subsample):
    learn = learner(task, mode, bs, micro, seed, subsample)
    p = PARAMS[task]
    t0 = time.perf_counter()
    with warnings.catch_warnings(), learn.no_bar(), learn.no_logging():
        warnings.simplefilter('ignore')
        learn.fit_one_cycle(epochs, p['lr'], **({'wd': p['wd']} if p['wd'] is not None else {}))
    secs = time.perf_counter()-t0
    with learn.no_bar(), learn.no_logging(): v = learn.validate()   # (valid loss, metrics: the final model's)
    return (v[0] if task == 'collab' else v[1]),secs

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--task', default='collab', choices=('collab', 'tabular', 'conv'))
    ap.add_argument('--seeds', type=int, default=3)
    ap.add_argument('--epochs', type=int, default=5)
    ap.add_argument('--bs', type=int, default=64)
    ap.add_argument('--micro', type=int, default=16)
    ap.add_argument('--subsample', type=float, default=1.)
    ap.add_argument('--modes', default=','.join(CONTENDERS))
    a = ap.parse_args(argv)
    import torch; torch.set_num_threads(1)
    modes = a.modes.split(',')
    res = {m: [run(a.task, m, a.bs, a.micro, s, a.epochs, a.subsample) for s in range(a.seeds)] for m in modes}
    base = np.mean([v for v,_ in res['large']]) if 'large' in res else None
    metric = PARAMS[a.task]['metric']
    sub = '' if a.subsample == 1 else f' of {a.subsample:.0%} of the training set each'
    print(f"task {a.task}: bs {a.bs}, micro-batches {a.micro} x {a.bs//a.micro}, {a.epochs} epochs{sub}, "
          f"{a.seeds} seeds; {metric}\n")
    print(f"| mode | {metric} (mean over seeds) | per seed | / large batch | time/run s |\n|---|---|---|---|---|")
    for m,rs in res.items():
        vs = [v for v,_ in rs]; mean = float(np.mean(vs))
        ratio = f'{mean/base:.3f}' if base else '—'
        per,secs = ', '.join(f'{v:.4f}' for v in vs),np.mean([t for _,t in rs])
        print(f"| {m} | {mean:.4f} | {per} | {ratio} | {secs:.1f} |")

if __name__ == '__main__': main()
