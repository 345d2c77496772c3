"""Which BatchNorm setting to advise (issue 32): final validation accuracy of 'pool', 'none' (plain BatchNorm on
micro-batches) and 'groupnorm', each with and without precise statistics (`BatchNormAccumulation(precise=512)`, or
`update_bn_stats` after fit for plain BatchNorm), against the large batch (also with and without), over micro-batches
of 2, 4 and 8 (32 items a step) in short runs and 4 in long ones, several seeds, on two tasks:

- `digits`: the job's transfer task (resnet_tiny pretrained on digits 0-4, fine-tuned on 5-9; one-cycle Adam 3e-3);
  short 1 epoch, long 6;
- `scratch`: the case a user reported: digits 0-2 (430 train / 107 valid, 32 px), `vision_learner(resnet18,
  pretrained=False)`, `fit_one_cycle(E, 1e-3)`; short 2 epochs, long 8.

One CSV row per run. Reproduce: `python bench/bn_precise_study.py --task digits --out docs/assets/bn_precise_digits.csv` and
`--task scratch --out docs/assets/bn_precise_scratch.csv` (about 10 and 25 minutes on one CPU core each), then
`python bench/bn_precise_study.py --plot docs/assets/bn_precise.png`."""
import argparse, csv, time, warnings
from pathlib import Path
import numpy as np

MODES = ('large', 'none', 'pool', 'groupnorm')
PRECISE = 512

def learner(task, mode, mb, precise, seed):
    import torch
    from fastai.vision.all import vision_learner, resnet18, Learner, accuracy, CrossEntropyLossFlat, set_seed
    from accum_callback import GradientAccumulation, BatchNormAccumulation
    from accum_finetune.data import digits_dls
    k = 1 if mode == 'large' else 32//mb
    bs = 32 if mode == 'large' else mb
    bna = ([BatchNormAccumulation(mode, precise=PRECISE if precise else None)] if mode in ('pool', 'groupnorm') else [])
    if task == 'digits':
        from accum_finetune.finetune import build_learner
        from accum_finetune.pretrain import pretrained_checkpoint
        dls = digits_dls(bs, seed=seed)
        learn = build_learner(dls, 'resnet_tiny', weights=str(pretrained_checkpoint()), n_step=k, bn='none', seed=seed, cbs=bna)
    else:
        set_seed(seed, reproducible=True)
        dls = digits_dls(bs, classes=(0, 1, 2), seed=seed, valid_pct=0.2)
        import random
        for i,dl in enumerate(dls.loaders): dl.rng = random.Random(seed+i)
        learn = vision_learner(dls, resnet18, pretrained=False, normalize=False, metrics=accuracy, loss_func=CrossEntropyLossFlat(),
                               cbs=[GradientAccumulation(n_step=k)] + bna)
    return learn

def run(task, mode, mb, precise, seed, epochs):
    from accum_callback import update_bn_stats
    from accum_callback.batchnorm.precise import training_items
    learn = learner(task, mode, mb, precise, seed)
    lr = 3e-3 if task == 'digits' else 1e-3
    t = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(epochs, lr)
        if precise and mode in ('large', 'none'):   # plain BatchNorm: the same recomputation, after fit
            update_bn_stats(learn.model, training_items(learn, PRECISE, None, seed=0))
        loss,acc = learn.validate()
    return dict(task=task, mode=mode, micro_bs=32 if mode == 'large' else mb, precise=int(precise), seed=seed, epochs=epochs,
                accuracy=float(acc), valid_loss=float(loss), seconds=round(time.perf_counter()-t, 1))

def configs(seeds, mbs=(2, 4, 8)):
    for seed in seeds:
        for precise in (0, 1):
            yield 'large', 32, precise, seed
            for mb in mbs:
                for mode in ('none', 'pool') + (('groupnorm',) if not precise else ()):   # groupnorm has no statistics
                    yield mode, mb, precise, seed

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--task', choices=('digits', 'scratch'))
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--out', type=Path)
    p.add_argument('--plot', type=Path, help='plot the CSVs in docs/ into this PNG and print the table')
    a = p.parse_args(argv)
    warnings.filterwarnings('ignore')
    import torch; torch.set_num_threads(1)
    if a.plot: return plot(a.plot)
    lengths = dict(digits=(1, 6), scratch=(2, 8))[a.task]   # short runs at micro-batches 2, 4, 8; long ones at 4
    rows = []
    with open(a.out, 'w', newline='') as f:
        w = None
        for epochs,mbs in zip(lengths, ((2, 4, 8), (4,))):
            for mode,mb,precise,seed in configs(range(a.seeds), mbs):
                r = run(a.task, mode, mb, precise, seed, epochs)
                if w is None: w = csv.DictWriter(f, fieldnames=list(r)); w.writeheader()
                w.writerow(r); f.flush(); rows.append(r)
                print(r, flush=True)

def summary(rows)->list:
    "(task, epochs, setting, micro_bs, precise, mean accuracy, sd over seeds (n-1), n)"
    from collections import defaultdict
    g = defaultdict(list)
    for r in rows: g[(r['task'], int(r['epochs']), r['mode'], int(r['micro_bs']), int(r['precise']))].append(float(r['accuracy']))
    return [(*k, float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else float('nan'), len(v)) for k,v in sorted(g.items())]

def load(paths)->list:
    rows = []
    for p in paths:
        with open(p) as f: rows += list(csv.DictReader(f))
    return rows

DOCS = Path(__file__).resolve().parents[1]/'docs'/'assets'
CSVS = (DOCS/'bn_precise_digits.csv', DOCS/'bn_precise_scratch.csv')

def table(s=None)->str:
    "The markdown table docs/batchnorm.md shows, from the recorded CSVs"
    s = summary(load(CSVS)) if s is None else s
    return '\n'.join(['| task | epochs | setting | micro-batch | accuracy (mean ± sd) | seeds |', '|---|---|---|---|---|---|'] +
                     [f"| {t} | {e} | {mode}{' + precise' if pr else ''} | {mb} | {m:.4f} ± {sd:.4f} | {n} |" for t,e,mode,mb,pr,m,sd,n in s])

def plot(png):
    import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt
    s = summary(load(CSVS))
    tasks = sorted({(t, e) for t,e,*_ in s})
    fig,axes = plt.subplots(1, len(tasks), figsize=(4*len(tasks), 3.6), sharey=False)
    for ax,(t,e) in zip(np.atleast_1d(axes), tasks):
        for mode in MODES:
            for precise,ls in ((0, '-'), (1, '--')):
                pts = sorted((mb, m) for tt,ee,mo,mb,pr,m,sd,n in s if (tt, ee, mo, pr) == (t, e, mode, precise))
                if pts: ax.plot(*zip(*pts), ls, marker='o', label=f"{mode}{' + precise' if precise else ''}")
        ax.set_xscale('log', base=2); ax.set_xlabel('micro-batch (32 items a step)'); ax.set_ylabel('validation accuracy')
        ax.set_title(f"{t}, {e} epoch{'s' if e > 1 else ''}")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.tight_layout(); fig.savefig(png, dpi=100)
    print(table(s))

if __name__ == '__main__': main()
