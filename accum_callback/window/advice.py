"""What `GradientAccumulation` says once at fit start: settings that may not mean what the user meant (a recipe ported
from fastai, a window over most of an epoch, nothing that accumulates) and layers that make a window other than the
large batch whatever the rule. Each warning names the argument and what to do; none changes what training does."""
from __future__ import annotations
import math, warnings

from ..core.distributed import is_fsdp
from ..core.losses import counting_note
from ..core.loaders import batch_sizes
from .schedule import windows_started
from ..core.protocols import user_stacklevel

__all__ = ['warn_at_fit_start', 'warn_counting']

def warn_at_fit_start(ga, bs):
    "Each of the warnings below, once (`ga.said`, the keys of what the callback has said: one about the window's size)"
    _nothing_accumulates(ga, bs)
    if 'window' not in ga.said: _ported(ga, bs)
    _not_large_batch(ga)
    _sharded_by_hand(ga)
    t = ga.plan.target_bs() if ga.plan.by_items and ga.plan.partial != 'carry' else None
    if t and bs and t > bs and t % bs and 'window' not in ga.said:
        warnings.warn(f"GradientAccumulation: micro-batch size {bs} does not divide target_bs={t}: windows close at "
                      f"the first micro-batch reaching it ({math.ceil(t/bs)*bs} items); each step is still the exact "
                      "mean gradient of its window", stacklevel=user_stacklevel())
        ga.said.add('window')

def _ported(ga, bs):
    """What a recipe ported from fastai may mean otherwise, said once at fit start with the steps an epoch each reading
    gives: a window over most of an epoch"""
    sizes = batch_sizes(ga.learn.dls.train) if bs else []
    if not sizes: return
    steps = lambda t, items: windows_started(sizes, t, items, 'step', False)
    sc = ga.plan.sched
    if sc.constant is None or ga.mb is not None: return
    by_items = ga.plan.by_items
    units = sc.constant if not by_items else next((i+1 for i in range(len(sizes)) if sum(sizes[:i+1]) >= sc.constant),
                                                  len(sizes)+1)
    name = 'n_step' if not by_items else 'target_bs'
    if units > len(sizes):   # an epoch shorter than the window: each window is the epoch, cut short at its end
        if ga.plan.partial == 'carry': return   # (carried over the epoch's end: the windows are whole)
        warnings.warn(f"GradientAccumulation: the epoch ({len(sizes)} loader batches of {bs}) is shorter than the "
                      f"window of {name}={sc.constant}: every window is the whole epoch, cut short at its end "
                      f"({partial_said(ga.plan.partial)}), {steps(sc.constant, by_items)} optimizer step(s) an epoch. "
                      f"Give a smaller {name} (at most {len(sizes) if not by_items else sum(sizes)}), or "
                      "partial='carry' to carry each window over the epoch's end", stacklevel=user_stacklevel())
        ga.said.add('window')
        return
    if units*2 > len(sizes) >= 8:   # a toy epoch of a few batches is a test or a demo, not a ported count
        warnings.warn(f"GradientAccumulation: {name}={sc.constant} makes a window of {min(units, len(sizes))} of the "
                      f"epoch's {len(sizes)} loader batches: {steps(sc.constant, by_items)} optimizer step(s) an "
                      "epoch. If that is not what you meant (fastai's count is samples, n_acc=; ours n_step= counts "
                      "batches), give a smaller one",
                      stacklevel=user_stacklevel())
        ga.said.add('window')

def partial_said(partial)->str:
    "What happens to the window left open at an epoch's end, in words"
    return {'drop': "dropped: partial='drop'",
            'carry': "carried into the next epoch"}.get(partial, "stepped: partial='step'")

def _not_large_batch(ga):
    "Layers that make a window other than the large batch whatever the rule, where cheap to see: said once"
    if 'layers' in ga.said: return
    spectral = [n for n,m in ga.learn.model.named_modules()
                if type(m).__name__ == '_SpectralNorm'
                or any(k.endswith('_u') and k[:-2] + '_orig' in dict(m.named_parameters(recurse=False))
                                                              for k,_ in m.named_buffers(recurse=False))]
    if spectral:
        warnings.warn("GradientAccumulation: spectral_norm "
                      f"({spectral[0]}{' and others' if len(spectral) > 1 else ''}) runs its power iteration at every "
                      "training forward: k micro-batches run it k times where one batch runs it once, so a window is "
                      "not exactly the large batch (small; docs/fastai.md)", stacklevel=user_stacklevel())
        ga.said.add('layers')

def _nothing_accumulates(ga, bs):
    "A setting under which no window holds more than one loader batch, uncut: said once, naming the argument"
    if not bs or 'window' in ga.said: return
    mb,msg = ga.mb,None
    size = mb.size if mb is not None and not mb.auto else None
    if size is not None and size > bs:
        msg = (f"MicroBatching({size}) is larger than the loader's batch ({bs}): no batch is cut, so nothing is "
               f"accumulated that the loader batch does not hold already: give a size below {bs}, or load larger "
               "batches")
    t = ga.plan.sched.constant if ga.plan.by_items else None
    if t is not None and t < bs and mb is None:
        name = 'target_bs'
        msg = (f"{name}={t} is below the loader's batch ({bs}): every window is one batch of {bs} items and "
               f"nothing accumulates (fastai's callback multiplied such a step's gradient by bs/{name} = {bs/t:g}). "
               f"For steps of {t} items, load batches smaller than {t}; for steps of several batches, give a larger "
               f"{name} or n_step")
    if msg:
        warnings.warn(f"GradientAccumulation: {msg}", stacklevel=user_stacklevel())
        ga.said.add('window')

def _sharded_by_hand(ga):
    "A model sharded with FSDP2 outside `to_fsdp`: fastai's save/load/export would write one rank's shard. Said once"
    learn = ga.learn
    if 'fsdp' in ga.said or not is_fsdp(learn.model) or 'save' in learn.__dict__: return
    warnings.warn("GradientAccumulation: the model is sharded with FSDP2 outside `learn.to_fsdp()`, so `learn.save`, "
                  "`load` and `export` are fastai's, which write and read one rank's shard: call "
                  "`learn.fsdp_checkpoints()` once for files of the whole model", stacklevel=user_stacklevel())
    ga.said.add('fsdp')

def warn_counting(ga):
    """At a fit's first micro-batch (the loss is needed to tell), once: a loss whose count this library cannot know
    where one other than the batch size is likely (a model's own loss it cannot match, -100 in the targets of an unknown
    loss)"""
    ga.said.add('count')
    note = counting_note(ga.learn, ga.n_items)
    if note: warnings.warn(f"GradientAccumulation: {note}", stacklevel=user_stacklevel())
