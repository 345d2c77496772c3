"""What the state of a fit is, besides the model and the optimizer: the callbacks' state (by the `state_dict()` protocol,
fastai's trackers through an adapter), the training loader's RNG and order state, the state a model carries from batch
to batch (what fastai's `ModelResetter` resets), and the Recorder's history. `Checkpoint` saves and restores them."""
from __future__ import annotations

import torch
from fastai.callback.tracker import TrackerCallback
from fastai.torch_core import to_device

from .fastai_compat import train_metrics
from .micro import stateful_modules

__all__ = ['callback_states', 'fit_arguments', 'carried_state', 'load_carried_state', 'loader_rngs', 'set_loader_rngs', 'loader_orders',
           'set_loader_orders', 'restore_recorder', 'plain_numbers']

def callback_states(learn, skip)->list:
    """`(key, callback, get, put)` for every callback on `learn` whose state a checkpoint keeps, by the protocol: one
    with `state_dict()`/`load_state_dict()` (ours, and any user's), and fastai's trackers (`EarlyStoppingCallback`,
    `SaveModelCallback`, `ReduceLROnPlateau`: their best value and patience) through a small adapter. Keyed by the
    callback's fastai name (`#2`... for a second one of a name), so that a resumed Learner finds each by what it is"""
    out,seen = [],{}
    for cb in learn.cbs:
        if cb is skip: continue
        # (looked up on the class: a fastai callback passes unknown names on to the Learner, and it to the model)
        if callable(getattr(type(cb), 'state_dict', None)) and callable(getattr(type(cb), 'load_state_dict', None)):
            get,put = cb.state_dict,cb.load_state_dict
        elif isinstance(cb, TrackerCallback):
            get = lambda cb=cb: {k: getattr(cb, k) for k in ('best', 'wait', 'new_best') if hasattr(cb, k)}
            put = lambda d, cb=cb: cb.__dict__.update(d)
        else: continue
        name = getattr(cb, 'name', type(cb).__name__)
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f'{name}#{seen[name]}', cb, get, put))
    return out

def _loaders(dl)->list:
    "The training loader and the loaders it wraps (`DistributedDL`'s), outermost first"
    out,seen = [],set()
    while dl is not None and id(dl) not in seen:
        seen.add(id(dl)); out.append(dl)
        dl = dl.__dict__.get('dl') if hasattr(dl, '__dict__') else None
    return out

def loader_rngs(dl)->list: return [l.rng.getstate() if hasattr(l, 'rng') and hasattr(l.rng, 'getstate') else None for l in _loaders(dl)]
def set_loader_rngs(dl, states:list):
    "Put `loader_rngs` back, innermost first (a run resumed on another number of processes wraps the loader otherwise)"
    for l,s in zip(reversed(_loaders(dl)), reversed(states)):
        if s is not None: l.rng.setstate(s)

def loader_orders(dl)->list:
    """The order state a loader keeps from one epoch to the next besides its RNG: fastai's `LMDataLoader` shuffles its
    texts in place (a `ReindexCollection`'s `idxs`), each epoch's order a shuffle of the last one's"""
    from fastcore.xtras import ReindexCollection
    out = []
    for l in _loaders(dl):
        items = l.__dict__.get('items') if hasattr(l, '__dict__') else None
        out.append([int(i) for i in items.idxs] if isinstance(items, ReindexCollection) else None)
    return out

def set_loader_orders(dl, saved):
    for l,o in zip(reversed(_loaders(dl)), reversed(saved or ())):
        if o is None: continue
        idxs = l.__dict__['items'].idxs   # in place: LMDataLoader's `lens` shares this very list
        for i,v in enumerate(o): idxs[i] = v
        if callable(getattr(l, 'make_chunks', None)): l.make_chunks()   # (LMDataLoader's chunks follow its order)


# -- the state a model carries from batch to batch -----------------------------------------------------------------------
def _carried_value(v)->bool:
    "A value a module's carried state may hold: tensors and numbers, in lists and tuples"
    if v is None or isinstance(v, (torch.Tensor, bool, int, float)): return True
    return type(v) in (list, tuple) and all(_carried_value(x) for x in v)

def carried_state(model)->dict:
    """What `model` carries from one batch to the next, by module name: what fastai's `ModelResetter` resets (AWD_LSTM's
    `hidden` and `bs`, any module with `reset()`: its attributes that are tensors or numbers), or what a module declares
    with `carried_state()` (then `load_carried_state(state)` puts it back)"""
    ok,bad = stateful_modules(model)
    names = {m: n for n,m in model.named_modules()}
    out = {}
    for m in [m for m,_ in ok] + bad:
        if callable(getattr(m, 'carried_state', None)): out[names[m]] = {'declared': m.carried_state()}
        else: out[names[m]] = {'attributes': {k: v for k,v in vars(m).items()
                                              if not k.startswith('_') and k != 'training' and _carried_value(v)}}
    return out

def load_carried_state(model, saved:dict):
    "Put back what `carried_state` took, on the device of `model`'s parameters"
    mods,dev = dict(model.named_modules()),next(iter(model.parameters()), torch.empty(0)).device
    for name,d in saved.items():
        m = mods.get(name)
        if m is None: continue
        if 'declared' in d: m.load_carried_state(d['declared'])
        else:
            for k,v in d['attributes'].items(): setattr(m, k, to_device(v, dev))
def restore_recorder(rec, saved:dict):
    "The Recorder's history and running training metrics as `Checkpoint._snapshot` saved them"
    for k,v in saved.items():
        if k not in ('smooth', 'mets'): setattr(rec, k, v)
    rec.smooth_loss.__dict__.update(saved['smooth'])
    for m,d in zip(train_metrics(rec), saved['mets']): m.__dict__.update(d)

def plain_numbers(obj)->dict:
    "A metric's running totals (numbers and tensors; not the function it calls, which may hold the Learner)"
    return {k: v for k,v in obj.__dict__.items() if isinstance(v, (int, float, bool, torch.Tensor, type(None)))}

def fit_arguments(learn)->dict:
    """What the fit was called with, read when it starts: the learning rate and weight decay per parameter group (as
    `fit` sets them; the momenta a previous fit's schedule left are not the fit's arguments) and every
    `ParamScheduler`'s schedules sampled at 0, 1/4, ... 1 of training (`fit_one_cycle`'s `lr_max`, `div`, `pct_start`,
    moms; `fit_flat_cos`, `fit_sgdr`...)"""
    from fastai.callback.schedule import ParamScheduler
    def num(v):
        try: return [num(x) for x in v] if isinstance(v, (list, tuple)) or getattr(v, 'ndim', 0) else float(v)
        except (TypeError, ValueError): return repr(v)
    hypers = [{k: num(h[k]) for k in ('lr', 'wd') if k in h} for h in learn.opt.hypers] if learn.opt is not None else None
    scheds = {k: [num(f(p)) for p in (0., .25, .5, .75, 1.)] for cb in learn.cbs if isinstance(cb, ParamScheduler)
              for k,f in cb.scheds.items()}
    return {'hyper-parameters': hypers, 'schedule': scheds or None}
