"The BatchNorm study: final accuracy of the default transfer task, large batch against micro-batches with each BN mode"
from __future__ import annotations
import time
from pathlib import Path

import pandas as pd

from .data import digits_dls
from .pretrain import pretrained_checkpoint
from .finetune import auto_bn, build_learner, finetune
from .models import DEFAULT_ARCH

__all__ = ['STUDY_MODES', 'run_study', 'summarize', 'plot_study']

from accum_callback.batchnorm.modes import BN_MODES
# plain BatchNorm at the micro-batch, then every mode the job's windows of loader batches take ('window' cuts one batch)
STUDY_MODES = ('none',) + tuple(m for m in BN_MODES if not m.startswith('window'))

def run_study(
    seeds=(0,1,2), # one fine-tuning run per seed and configuration
    micro_bss=(2,4), # micro-batch sizes, each accumulated up to `effective_bs`
    modes=STUDY_MODES, # BatchNorm modes tried at every micro-batch size
    epochs:int=3, # fine-tuning epochs (the CLI default)
    effective_bs:int=32, # the large-batch reference's batch size, and every run's items per optimizer step
    lr:float=3e-3, size:int=32, arch:str=DEFAULT_ARCH,
    pretrained:bool=True, # start from the digits 0-4 checkpoint (the CLI default), or from random weights
    csv=None, # append each finished run to this CSV (a long study can be read while it runs)
    verbose:bool=True,
)->pd.DataFrame:
    "One row per run: `config`, `micro_bs`, `n_step`, `bn`, `seed`, `accuracy`, `seconds`"
    weights = str(pretrained_checkpoint(arch, size)) if pretrained else None
    configs = [(effective_bs, 'none')] + [(m, b) for m in micro_bss for b in modes]
    rows = []
    if csv is not None and Path(csv).exists(): Path(csv).unlink()
    for seed in seeds:
        for mbs,bn in configs:
            t0 = time.perf_counter()
            dls = digits_dls(mbs, size=size, seed=seed)
            learn = build_learner(dls, arch, weights=weights, n_step=effective_bs//mbs, bn=bn, lr=lr, seed=seed)
            m = finetune(learn, epochs, lr, progress=False)
            ref = mbs == effective_bs
            rows.append(dict(config='large batch' if ref else f'{mbs} x {effective_bs//mbs}', micro_bs=mbs,
                             n_step=effective_bs//mbs, bn='-' if ref else bn, seed=seed, accuracy=m['accuracy'],
                             seconds=round(time.perf_counter()-t0, 1)))
            if csv is not None: pd.DataFrame(rows[-1:]).to_csv(csv, mode='a', header=len(rows) == 1, index=False)
            if verbose: print(' '.join(f'{k}={v}' for k,v in rows[-1].items()), flush=True)
    return pd.DataFrame(rows)

def summarize(df:pd.DataFrame, pretrained:bool=True)->pd.DataFrame:
    "Mean, std and count of accuracy per configuration, with the gap to the large batch in points and `auto`'s pick"
    g = df.groupby(['config', 'micro_bs', 'bn'], sort=False)['accuracy'].agg(['mean', 'std', 'count']).reset_index()
    ref = g.loc[g.config == 'large batch', 'mean']
    g['gap_pts'] = ((g['mean']-ref.iloc[0])*100).round(2) if len(ref) else float('nan')
    g['auto'] = [r.bn == auto_bn(r.micro_bs, 2, pretrained) if r.config != 'large batch' else True
                 for r in g.itertuples()]
    return g

def plot_study(df:pd.DataFrame, fname=None, ax=None):
    "Bar chart of mean accuracy (error bars: std over seeds) per micro-batch size and BN mode, large batch as a line"
    import matplotlib.pyplot as plt
    s = summarize(df)
    if ax is None: _,ax = plt.subplots(figsize=(8,4))
    ref = s[s.config == 'large batch']
    micro = s[s.config != 'large batch']
    modes = list(dict.fromkeys(micro.bn)); cfgs = list(dict.fromkeys(micro.config))
    w = 0.8/max(len(cfgs), 1)
    for i,c in enumerate(cfgs):
        d = micro[micro.config == c].set_index('bn').reindex(modes)
        ax.bar([j+i*w for j in range(len(modes))], d['mean'], w, yerr=d['std'].fillna(0), capsize=3,
               label=f'micro-batch {c}')
    if len(ref):
        m = ref['mean'].iloc[0]
        ax.axhline(m, color='k', ls='--', lw=1, label=f'large batch {int(ref.micro_bs.iloc[0])}: {m:.3f}')
    ax.set_xticks([j+w*(len(cfgs)-1)/2 for j in range(len(modes))]); ax.set_xticklabels(modes)
    lo = min(s['mean'].min()-s['std'].fillna(0).max(), 0.9)
    ax.set_ylim(max(lo-0.02, 0), 1.0); ax.set_ylabel('final validation accuracy'); ax.set_xlabel('BatchNorm mode')
    ax.set_title(f"digits 0-4 -> 5-9 transfer, {df.seed.nunique()} seed(s)"); ax.legend(fontsize=8, loc='lower left')
    if fname is not None: ax.figure.tight_layout(); ax.figure.savefig(fname, dpi=100)
    return ax
