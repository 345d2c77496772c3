"""Which window rule pays (issue 40): final validation accuracy, optimizer steps and wall time of fixed windows, a step
learning-rate decay, notebook 03's hand-made growth (Smith et al. 2018) and windows grown with the measured noise scale
(with the learning rate kept, scaled linearly, by the square root, or by AdaScale's gain), at equal epochs (equal
samples seen), several seeds, on two tasks:

- `transfer`: notebook 04's task, the job's (resnet_tiny pretrained on digits 0-4, fine-tuned on 5-9, 717 training
  images, 'pool'), SGD with momentum 0.9, learning rate 1e-2, micro-batches of 4, a base window of 8 items;
- `scratch`: the same network from scratch on all ten digits (1,438 training images, 'pool'), the same optimiser and
  learning rate 2e-2, micro-batches of 4, a base window of 8 items.

Every rule sees the same samples in the same order (the loader's seed); one CSV row per run. Reproduce:
`python bench/noise_study.py --task transfer --out docs/assets/noise_study_transfer.csv` and `--task scratch --out
docs/assets/noise_study_scratch.csv` (about 15 and 35 minutes on 2 CPU cores with `--jobs 2`; the recorded CSVs were made in
two passes, the last three rules added after the first eight), then `python bench/noise_study.py --plot docs/assets/noise_study.png`.
The rule `noise/2+lin+decay, hi 64` is `noise.schedule(lo=8)` at its defaults beside the decay."""
import argparse, csv, math, time, warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MICRO_BS, BASE = 4, 8     # micro-batch, base window (items)
HI = 128                  # the grown window's cap (items)
LR = dict(transfer=1e-2, scratch=2e-2)
EPOCHS = dict(transfer=8, scratch=8)

# rule: (window, learning-rate rule); the window: 'fixed', 'growth' (x4 at 1/3 and 2/3: 8, 32, 128) or a fraction of
# B_simple; the learning rate: 'const', 'decay' (/4 at 1/3 and 2/3, notebook 03's), or scaled with the window B
# ('linear' B/8, 'sqrt', 'adascale' AdaScale's gain from the measured B_simple), with or without the decay
RULES = {
    'fixed':              ('fixed', 'const', None),
    'fixed+decay':        ('fixed', 'decay', None),
    'growth (nb 03)':     ('growth', 'const', None),
    'noise (0.2.0)':      (1.0, 'const', None),
    'noise/4':            (0.25, 'const', None),
    'noise+ada':          (1.0, 'const', 'adascale'),
    'noise+sqrt+decay':   (1.0, 'decay', 'sqrt'),
    'noise+ada+decay':    (1.0, 'decay', 'adascale'),
    'noise/2+lin+decay':  (0.5, 'decay', 'linear'),
    'noise/4+lin+decay':  (0.25, 'decay', 'linear'),
    'noise/2+sqrt+decay': (0.5, 'decay', 'sqrt'),
    'noise/2+lin+decay, hi 64': (0.5, 'decay', 'linear', 64),
}

def decay(pct:float)->float: return 1. if pct < 1/3 else (1/4 if pct < 2/3 else 1/16)

def gain(kind, B, b_simple)->float:
    "How much the step's learning rate is multiplied for a window of B items against the base window"
    if kind is None: return 1.
    if kind == 'linear': return B/BASE
    if kind == 'sqrt': return math.sqrt(B/BASE)
    # AdaScale (Johnson et al. 2020): r = (tr/b0 + |G|^2)/(tr/B + |G|^2) = (Bs/b0 + 1)/(Bs/B + 1)
    if not math.isfinite(b_simple) or b_simple <= 0: return B/BASE if math.isinf(b_simple) else 1.
    return (b_simple/BASE + 1)/(b_simple/B + 1)

def run(task, rule, seed):
    warnings.filterwarnings('ignore')
    import torch
    torch.set_num_threads(1)
    from fastai.vision.all import Learner, accuracy, CrossEntropyLossFlat, SGD, set_seed, Callback
    from functools import partial
    from accum_callback import GradientAccumulation, BatchNormAccumulation, GradientNoiseScale
    from accum_finetune.data import digits_dls
    from accum_finetune.models import DEFAULT_ARCH, create_model, load_weights
    window,lr_rule,scale,hi = (RULES[rule] + (HI,))[:4]
    lr = LR[task]
    set_seed(seed, reproducible=True)
    if task == 'transfer':
        from accum_finetune.pretrain import pretrained_checkpoint
        dls = digits_dls(MICRO_BS, seed=seed)
        model = create_model(DEFAULT_ARCH, dls.c); load_weights(model, str(pretrained_checkpoint()), DEFAULT_ARCH)
    else:
        dls = digits_dls(MICRO_BS, classes=tuple(range(10)), seed=seed)
        model = create_model(DEFAULT_ARCH, dls.c)
    noise = GradientNoiseScale()
    if window == 'fixed': target = BASE
    elif window == 'growth': target = lambda pct=0., epoch=0: BASE if pct < 1/3 else (4*BASE if pct < 2/3 else 16*BASE)
    elif scale in ('sched-linear', 'sched-sqrt', 'sched-auto'):   # the library's rule: noise.schedule(lr=...)
        target = noise.schedule(fraction=window, lo=BASE, hi=hi, lr=scale[6:]); scale = None
    else: target = noise.schedule(fraction=window, lo=BASE, hi=hi)
    ga = GradientAccumulation(target_bs=target)

    class LRRule(Callback):
        "The step's learning rate: the base times the decay at the window's start and the gain for its size"
        order,run_valid = GradientAccumulation.order+2,False
        def before_step(self):
            r = ga.window.record
            if r is None: return
            f = (decay(self.pct_train) if lr_rule == 'decay' else 1.)*gain(scale, r.items, noise.b_simple)
            now = self.opt.hypers[0]['lr']   # the fit's learning rate, or the window's scaled by `schedule(lr=...)`
            self.opt.set_hyper('lr', now*f); self.lrs.append(now*f)
        def after_step(self): self.opt.set_hyper('lr', lr)   # (every fit here is at the constant `lr`)
    lrr = LRRule(); lrr.lrs = []
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, opt_func=partial(SGD, mom=0.9),
                    cbs=[ga, BatchNormAccumulation('pool'), noise, lrr])
    t = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        learn.fit(EPOCHS[task], lr)
        secs = time.perf_counter() - t
        loss,acc = learn.validate()
    sizes = list(ga.window_sizes)
    return dict(task=task, rule=rule, seed=seed, epochs=EPOCHS[task], accuracy=round(float(acc), 4),
                valid_loss=round(float(loss), 4), steps=ga.steps, seconds=round(secs, 1),
                mean_window=round(sum(sizes)/max(len(sizes), 1), 1), max_window=max(sizes, default=0),
                max_lr=round(max(lrr.lrs, default=lr), 4), b_simple_end=round(noise.b_simple, 1))

CSVS = ('docs/assets/noise_study_transfer.csv', 'docs/assets/noise_study_scratch.csv')
REFERENCE = 'fixed+decay'   # the rule a grown window must match: the LR decay
DEFAULT = 'noise/2+lin+decay, hi 64'   # `noise.schedule()` at its defaults (fraction 0.5, lr 'auto': linear for SGD, hi 8 x lo), with the user's decay
GOAL_PTS,GOAL_STEPS = 0.5,3.   # within 0.5 points of the LR decay's mean accuracy, in at least 3x fewer optimizer steps

def load(paths=CSVS)->list:
    root = Path(__file__).resolve().parents[1]
    return [r for p in paths if (root/p).exists() for r in csv.DictReader(open(root/p))]

def stats(rows)->dict:
    "{(task, rule): (mean accuracy, sd, mean steps, mean seconds, seeds)}"
    import numpy as np
    out = {}
    for r in rows: out.setdefault((r['task'], r['rule']), []).append(r)
    return {k: (float(np.mean([float(r['accuracy']) for r in v])), float(np.std([float(r['accuracy']) for r in v])),
                float(np.mean([int(r['steps']) for r in v])), float(np.mean([float(r['seconds']) for r in v])), len(v))
            for k,v in out.items()}

def choice(rows)->tuple:
    """The rule to default to: among the grown windows (`noise*`), those within GOAL_PTS of the LR decay's mean on every
    task in GOAL_STEPS times fewer steps; if none, the one with the smallest worst-task gap. Returns (rule, met, gaps)"""
    st = stats(rows)
    tasks = sorted({t for t,_ in st})
    rules = [r for r in dict.fromkeys(k[1] for k in st) if r.startswith('noise') and all((t, r) in st for t in tasks)]
    gap = lambda r: {t: 100*(st[(t, REFERENCE)][0] - st[(t, r)][0]) for t in tasks}
    fewer = lambda r: {t: st[(t, REFERENCE)][2]/st[(t, r)][2] for t in tasks}
    met = [r for r in rules if all(g <= GOAL_PTS for g in gap(r).values()) and all(f >= GOAL_STEPS for f in fewer(r).values())]
    pick = min(met or rules, key=lambda r: max(gap(r).values()))
    return pick,bool(met),gap(pick),fewer(pick)

def table(rows=None)->str:
    "The markdown table docs/noise_scale.md shows, from the recorded CSVs"
    rows = load() if rows is None else rows
    st = stats(rows)
    pick = choice(rows)[0]
    out = ['| task | rule | accuracy (mean ± sd) | per seed | below the LR decay (pts) | optimizer steps | fewer steps | s a run |',
           '|---|---|---|---|---|---|---|---|']
    for (t,r),(m,sd,steps,secs,n) in st.items():
        ref = st[(t, REFERENCE)]
        name = f'**{r}** (default)' if r == pick else r
        seeds = ' '.join(f"{float(x['accuracy']):.3f}" for x in sorted((x for x in rows if (x['task'], x['rule']) == (t, r)), key=lambda x: int(x['seed'])))
        out.append(f"| {t} | {name} | {m:.4f} ± {sd:.4f} | {seeds} | {100*(ref[0]-m):+.2f} | {steps:.0f} | {ref[2]/steps:.1f}x | {secs:.0f} |")
    return '\n'.join(out)

def summary(rows):
    import numpy as np
    out = []
    for task in dict.fromkeys(r['task'] for r in rows):
        out.append(f"{task}: rule, accuracy mean ± sd (per seed), optimizer steps, seconds")
        for rule in dict.fromkeys(r['rule'] for r in rows if r['task'] == task):
            rs = [r for r in rows if r['task'] == task and r['rule'] == rule]
            acc = np.array([float(r['accuracy']) for r in rs])
            out.append(f"  {rule:20s} {acc.mean():.4f} ± {acc.std():.4f} ({', '.join(f'{a:.3f}' for a in acc)})  "
                       f"steps {np.mean([int(r['steps']) for r in rs]):6.0f}  {np.mean([float(r['seconds']) for r in rs]):5.1f} s")
    return '\n'.join(out)

def plot(paths, out):
    import numpy as np, matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig,axs = plt.subplots(1, len(paths), figsize=(6*len(paths), 4))
    for ax,p in zip(np.atleast_1d(axs), paths):
        rows = list(csv.DictReader(open(p)))
        for i,rule in enumerate(dict.fromkeys(r['rule'] for r in rows)):
            rs = [r for r in rows if r['rule'] == rule]
            st,acc = [int(r['steps']) for r in rs],[float(r['accuracy']) for r in rs]
            ax.errorbar(np.mean(st), np.mean(acc), yerr=np.std(acc), fmt='os^Dv'[i % 5], capsize=3, color=plt.cm.tab20(i),
                        label=rule + (' (default)' if rule == DEFAULT else ''), ms=9 if rule == DEFAULT else 6)
        ax.set_xscale('log'); ax.set_xlabel('optimizer steps (mean over seeds)'); ax.set_ylabel('validation accuracy')
        ax.set_title(f"{rows[0]['task']} ({rows[0]['epochs']} epochs, {len(set(r['seed'] for r in rows))} seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout(); fig.savefig(out, dpi=110)

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--task', choices=sorted(LR), default='transfer')
    ap.add_argument('--seeds', type=int, default=5)
    ap.add_argument('--rules', nargs='*', default=list(RULES), help='which of: ' + ', '.join(RULES))
    ap.add_argument('--epochs', type=int, default=None)
    ap.add_argument('--jobs', type=int, default=2)
    ap.add_argument('--out', default=None)
    ap.add_argument('--plot', default=None, help='draw docs/noise_study_*.csv into this figure, print the table and exit')
    a = ap.parse_args()
    if a.plot:
        plot([p for p in CSVS if Path(p).exists()], a.plot); print(table()); print(choice(load()))
        raise SystemExit
    if a.epochs: EPOCHS[a.task] = a.epochs
    jobs = [(a.task, rule, seed) for seed in range(a.seeds) for rule in a.rules]
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for r in ex.map(run, *zip(*jobs)):
            rows.append(r); print(r, flush=True)
            if a.out:
                with open(a.out, 'w', newline='') as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0])); w.writeheader(); w.writerows(rows)
    print(summary(rows))
