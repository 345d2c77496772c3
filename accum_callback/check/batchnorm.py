"""`learn.check_batchnorm()`: how stale are the BatchNorm layers' running statistics against those of the current
weights, and does it matter? The statistics are recomputed on the replay engine's copy of the model (`replay`), with
`precise.precise_bn_stats`, and the validation run both ways; the Learner is left as it was."""
from __future__ import annotations
from dataclasses import dataclass

from fastai.learner import Learner
from fastcore.basics import patch

from ..core.distributed import is_fsdp
from ..micro import copy_module, micro_size
from ..compat.torch import rngs_kept
from ..batchnorm.precise import bn_layers_with_stats, precise_bn_stats, recorder_kept, trained_bn_layers, training_items
from .replay import training_model
from ..core.args import whole_number

__all__ = ['BatchNormReport', 'check_batchnorm']

# -- learn.check_batchnorm(): how stale are the running statistics? ----------------------------------------------------

@dataclass
class BatchNormReport:
    """What `learn.check_batchnorm()` measured: per BatchNorm layer, how far its running statistics are from those of
    the current weights (`layers`: name, mean's distance in units of the precise standard deviation (RMS over channels),
    variance's relative error), the `worst` three, and the validation results (`names`) with the running statistics
    (`running`) and with the recomputed ones (`precise`), on `n_items` training items; `advice`"""
    layers: list
    worst: list
    names: list
    running: list
    precise: list
    n_items: int
    advice: str = ''

    def rows(self)->list:
        fmt = lambda vs: ', '.join(f'{n} {v:.4f}' for n,v in zip(self.names, vs))
        rows = [('layers',
                 f'{len(self.layers)} BatchNorm layers, statistics recomputed from {self.n_items} training items'),
                ('worst layers', ', '.join(f'{n} (mean {m:.2f} sd off, var {v:.0%})' for n,m,v in self.worst)),
                ('validation, running', fmt(self.running)), ('validation, precise', fmt(self.precise))]
        return rows + [('advice', self.advice)]
    def __str__(self):
        rows = self.rows(); w = max(len(k) for k,_ in rows)
        return '\n'.join(['check_batchnorm', '-'*(w+60)] + [f'{k:<{w}}  {v}' for k,v in rows])
    __repr__ = __str__
    def _repr_markdown_(self):
        return '| check_batchnorm | |\n|---|---|\n' + '\n'.join(f'| {k} | {v} |' for k,v in self.rows())

def _check_batchnorm(learn, n_items:int=512)->BatchNormReport:
    n_items = whole_number(n_items, 'n_items')
    if is_fsdp(learn.model):
        raise ValueError("check_batchnorm: the model is sharded with FSDP2; check before sharding it")
    model = training_model(learn)   # (as the check and the noise scale replay it; BatchNorm layers as they train)
    if not bn_layers_with_stats(model):
        raise ValueError("check_batchnorm: the model has no BatchNorm layer with running statistics: nothing to check")
    copy = copy_module(model)
    names = {m: n for n,m in copy.named_modules()}
    trained = {id(bn) for bn in trained_bn_layers(model, learn)}   # frozen layers are not stale: they are kept
    layers = [c for o,c in zip(model.modules(), copy.modules()) if id(o) in trained
              and getattr(c, 'running_mean', None) is not None]
    if not layers: raise ValueError("check_batchnorm: every BatchNorm layer is frozen (BnFreeze, 'freeze'): training "
                                    "keeps their statistics as they are, so there is nothing to recompute")
    # (the same items on every rank)
    stats = precise_bn_stats(copy, training_items(learn, n_items, micro_size(learn), world=1), layers=layers)
    layers = []
    for bn,s in stats.items():
        if s.s1 is None: continue
        sd = s.var.sqrt().clamp_min(1e-12)
        dm = float(((bn.running_mean.double() - s.mean)/sd).square().mean().sqrt())
        dv = float((bn.running_var.double() - s.var).norm()/s.var.norm().clamp_min(1e-30))
        layers.append((names[bn] or '<root>', dm, dv))
    worst = sorted(layers, key=lambda l: -max(l[1], l[2]))[:3]
    with learn.no_bar(), recorder_kept(learn): running = [float(v) for v in learn.validate()]
    for bn,s in stats.items():
        if s.s1 is not None:
            bn.running_mean.copy_(s.mean.to(bn.running_mean.dtype))
            bn.running_var.copy_(s.var.to(bn.running_var.dtype))
    saved = learn.model
    learn.model = copy
    try:
        with learn.no_bar(), recorder_kept(learn): precise = [float(v) for v in learn.validate()]
    finally: learn.model = saved
    names_ = ['valid_loss'] + [getattr(m, 'name', type(m).__name__) for m in learn.metrics]
    better = precise[0] < running[0]
    advice = ("the running statistics lag the weights: recompute them, `BatchNormAccumulation(mode, precise=N)` (every "
              "epoch) or `update_bn_stats(learn.model, ...)` after fit" if better else
              "the running statistics serve the current weights as well as recomputed ones: nothing to do")
    return BatchNormReport(layers=layers, worst=worst, names=names_, running=running, precise=precise,
                           n_items=stats.n_items, advice=advice)

@patch
def check_batchnorm(self:Learner,
    n_items:int=512, # training items to recompute the statistics from (the Learner's micro-batches)
)->BatchNormReport:
    """How far are the BatchNorm layers' running statistics from those of the current weights, and does it matter?
    Recomputes them on a copy of the model (`precise_bn_stats`) and validates both ways; changes nothing (RNGs included:
    fastai's validation draws from torch's)"""
    with rngs_kept(): return _check_batchnorm(self, n_items)
