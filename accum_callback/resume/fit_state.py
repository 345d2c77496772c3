"""What the state of a fit is, besides the model and the optimizer: the callbacks' state (by the `state_dict()` protocol,
fastai's trackers through an adapter), the training loader's RNG and order state, the state a model carries from batch
to batch (what fastai's `ModelResetter` resets), and the Recorder's history. `Checkpoint` saves and restores them."""
from __future__ import annotations

import warnings

import torch
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.tracker import TrackerCallback
from fastai.torch_core import to_device

from .format import CheckpointError, reshard
from ..compat.torch import local_tensor, rng_states, set_rng_states
from ..core.distributed import unwrap
from ..core.protocols import resume_keys, resume_signatures, user_stacklevel
from ..compat.fastai import train_metrics
from ..micro.state import stateful_modules

_RECORDER_KEYS = ('lrs', 'iters', 'losses', 'values')

__all__ = ['refuse_changes', 'signature_changes', 'training_state', 'apply_training_state', 'check_fit_state', 'fit_signature', 'data_identity', 'callback_states', 'fit_arguments', 'carried_state', 'load_carried_state', 'loader_rngs', 'set_loader_rngs', 'settle_loaders', 'loader_orders',
           'set_loader_orders', 'restore_recorder', 'recorder_state', 'plain_numbers']

def refuse_changes(old:dict, new:dict, f, strict:bool=True):
    """A resume of the checkpoint `f`, whose fit's signature was `old`, where it is `new` now: refused naming what
    changed (`strict`), or said in a warning; a model of other shapes is refused whatever `strict` says"""
    changed = signature_changes(old, new)
    if not changed: return
    if 'model' in changed:
        raise CheckpointError(f"Checkpoint: {f} is of a model of other shapes; start afresh with "
                              "Checkpoint(..., resume=False) or another `path`")
    what = '; '.join(_say_change(k, old.get(k), new.get(k)) for k in changed)
    if strict:
        raise CheckpointError(f"Checkpoint: cannot resume {f} exactly, {what}. Run the fit as it was, "
                              "start afresh with Checkpoint(..., resume=False) or another `path`, or accept it with strict=False")
    warnings.warn(f"Checkpoint: resuming {f} with {what} (strict=False): not the run it would have been", stacklevel=user_stacklevel())

def _say_change(k:str, old, new)->str:
    "One changed key of a fit's signature in words: a schedule or hyper-parameters by the values that changed, not whole"
    if k == 'schedule' and isinstance(old, dict) and isinstance(new, dict):
        peak = lambda v: max(_flat(v)) if _flat(v) else v
        said = [f"{'lr_max' if h == 'lr' else h} {_num(peak(old.get(h)))} then, {_num(peak(new.get(h)))} now"
                for h in dict.fromkeys([*old, *new]) if old.get(h) != new.get(h)]
        return f"the schedule's {'; '.join(said)} (its peak)" if said else f"{k} changed"
    if k == 'hyper-parameters' and isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        said = [f"{h} {_num(a.get(h))} then, {_num(b.get(h))} now" for a,b in zip(old, new) if isinstance(a, dict) and isinstance(b, dict)
                for h in dict.fromkeys([*a, *b]) if a.get(h) != b.get(h)]
        return f"the fit's {'; '.join(dict.fromkeys(said))}" if said else f"{k} changed"
    return f"{k}: {old!r:.200} then, {new!r:.200} now"

def _flat(v)->list: return [y for x in v for y in _flat(x)] if isinstance(v, (list, tuple)) else ([v] if isinstance(v, (int, float)) else [])
def _num(v)->str: return f"{v:.3g}" if isinstance(v, float) else repr(v)

def signature_changes(old:dict, new:dict)->list:
    """The keys whose values differ between a checkpoint's signature `old` and this fit's `new`: every key `old` holds
    (one it lacks, from an older file, is not asked of it), and a declared one (`ResumeSignature`) it lacks but set now"""
    keys = set(resume_keys())
    return [k for k in old if old.get(k) != new.get(k)] + [k for k in new if k not in old and k in keys and new[k] is not None]

def _scaler(learn):
    mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
    return getattr(mp, 'scaler', None) if mp is not None else None

def training_state(learn, skip, whole:bool=True)->dict:
    """What training has made, a piece of a fit's state: the model (`whole`; else nothing, a DCP folder holds it) and the
    gradients a window has accumulated so far, the optimizer with fastai's hyper-parameters, the grad scaler, the
    Recorder's history and every callback's state but `skip`'s (`callback_states`). Tensors as they are: a checkpoint
    copies them (`format.packed_state`)"""
    model,sc = unwrap(learn.model),_scaler(learn)
    return dict(model={k: local_tensor(v) for k,v in model.state_dict().items()} if whole else {},
                grads=[None if p.grad is None or not whole else local_tensor(p.grad) for p in model.parameters()],
                opt=learn.opt.state_dict() if learn.opt is not None else None, scaler=sc.state_dict() if sc is not None else None,
                recorder=recorder_state(learn.recorder), callbacks={k: get() for k,_,get,_ in callback_states(learn, skip)})

@torch.no_grad()
def apply_training_state(learn, st:dict, skip):
    "Put back what `training_state` took (checked whole before: `check_fit_state`)"
    model = unwrap(learn.model)
    sd = model.state_dict()
    for k,v in st['model'].items(): local_tensor(sd[k]).copy_(v)
    for p,g in zip(model.parameters(), st['grads']):
        if g is None: p.grad = None
        elif p.grad is None: p.grad = g.to(local_tensor(p).device) if not hasattr(p, 'to_local') else None
        else: local_tensor(p.grad).copy_(g)
    if st['opt'] is not None and learn.opt is not None:
        ps = [p for p,*_ in learn.opt.all_params(with_grad=False)]
        o = st['opt']
        if 'param_groups' in o:   # torch's (`OptimWrapper`): each parameter's state by its index
            o['state'] = {i: reshard(s_, ps[i]) for i,s_ in o['state'].items()}
        elif len(ps) == len(o.get('state', ())):   # (FSDP2: each parameter's state as its DTensor again)
            o['state'] = [reshard(s_, p) for s_,p in zip(o['state'], ps)]
        learn.opt.load_state_dict(o)
    if st['scaler'] is not None and (sc := _scaler(learn)) is not None: sc.load_state_dict(st['scaler'])
    restore_recorder(learn.recorder, st['recorder'])
    for k,_,_,put in callback_states(learn, skip):
        if k in st['callbacks']: put(st['callbacks'][k])

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
            put = lambda d, cb=cb: [setattr(cb, k, d[k]) for k in ('best', 'wait', 'new_best') if k in d]
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

def settle_loaders(dls):
    """What a loader computes once, lazily, done now: fastai's `TfmdDL` runs one pass of its transforms the first time its
    `n_inp` is read (the first batch's `Learner._split`), and random transforms in that pass draw from the global RNGs. The
    uninterrupted run drew them at its first batch, before any checkpoint: a resumed one must draw them before the RNGs
    are put back, not at its first batch after (they shifted every later draw)"""
    for dl in getattr(dls, 'loaders', None) or []:
        try: getattr(dl, 'n_inp', None)
        except Exception: pass   # (a loader that cannot make an item without data: it computes nothing lazily either)

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
        else:   # (the attributes the module has, holding what a carried state holds: no other name a file gives)
            for k,v in d['attributes'].items():
                if not k.startswith('_') and hasattr(m, k) and _carried_value(v): setattr(m, k, to_device(v, dev))
def _fits(v, now)->bool:
    """Can `v` (from a file) take the place of `now` (what the object holds): a number of its kind (an int of at most 2**53:
    a count a file made huge overflowed fastai's smoothing), a tensor of its shape, or None where it holds None"""
    if v is None: return now is None
    if now is None: return isinstance(v, (int, float, torch.Tensor))
    if isinstance(now, bool) or isinstance(v, bool): return type(v) is type(now)
    if isinstance(now, torch.Tensor): return isinstance(v, torch.Tensor) and v.shape == now.shape
    if isinstance(now, int): return type(v) is int and abs(v) <= 2**53
    return type(v) in (int, float) and abs(v) <= 2**1023

_SETTINGS = ('beta',)   # numbers a metric is made with, not what it has counted: never taken from a file (beta=9 overflowed)

def _declared(obj, saved:dict)->list:
    "`(name, value, fits)` of the numbers `saved` names that `obj` holds and has counted (`plain_numbers`, not `_SETTINGS`)"
    have = plain_numbers(obj)
    return [(k, v, _fits(v, have[k])) for k,v in saved.items() if k in have and k not in _SETTINGS]

def declared_fits(obj, saved)->bool:
    "Do the numbers `saved` names, that `obj` holds and has counted, fit what it holds (`_fits`)?"
    return isinstance(saved, dict) and all(ok for _,_,ok in _declared(obj, saved))

def _update_declared(obj, saved:dict):
    "Set on `obj` the numbers of `saved` that it holds already (`plain_numbers`) and that fit them: no other attribute a file names"
    for k,v,ok in _declared(obj, saved):
        if ok: setattr(obj, k, v)

def recorder_state(rec)->dict:
    """The Recorder's history and running training metrics. Its losses (a 0-d tensor a batch) as one tensor: a checkpoint
    a step of a long fit would otherwise pickle every loss so far, one object each, every time"""
    out = {k: getattr(rec, k) for k in _RECORDER_KEYS if hasattr(rec, k)}
    ls = out.get('losses')
    if ls and all(isinstance(l, torch.Tensor) and l.ndim == 0 and l.dtype == ls[0].dtype and l.device == ls[0].device for l in ls):
        out['losses'] = torch.stack(ls)
    return dict(out, smooth=plain_numbers(rec.smooth_loss), mets=[plain_numbers(m) for m in train_metrics(rec)])

def restore_recorder(rec, saved:dict):
    "The Recorder's history and running training metrics as `recorder_state` took them (those attributes only)"
    for k in _RECORDER_KEYS:
        if k in saved: setattr(rec, k, list(saved[k].unbind()) if isinstance(saved[k], torch.Tensor) else saved[k])
    _update_declared(rec.smooth_loss, saved['smooth'])
    for m,d in zip(train_metrics(rec), saved['mets']): _update_declared(m, d)

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

# -- a checkpoint's state, checked whole before any of it is applied -------------------------------------------------------

def check_fit_state(st, learn, skip, where:str='the checkpoint', now:dict|None=None):
    """`ValueError` naming the first thing in `st` (a checkpoint's state, as `Checkpoint` saves it) that cannot be applied
    to `learn` as it is: the place, the model's tensors and gradients (shapes), the optimizer's and the Recorder's
    structure, the RNG states, and every callback's state (each tried with its `load_state_dict`, then its own state
    put back). Nothing is changed: a file that fails here is passed over, not half applied. `now`: this fit's signature;
    a file whose signature differs (another fit: refused by the resume, naming what changed) is checked no deeper"""
    def need(ok, what):
        if not ok: raise ValueError(f"{where}: {what}")
    need(isinstance(st, dict), 'is not a dict')
    need(st.get('where') in ('mid', 'end', 'done'), f"'where' is {st.get('where')!r}")
    for k in ('world', 'epoch', 'k'): need(type(st.get(k)) is int and st[k] >= 0, f'{k!r} is {st.get(k)!r}')
    need(isinstance(st.get('signature'), dict) and type(st['signature'].get('fit')) is int, 'its signature is malformed')
    if now is not None and any(k != 'FSDP2' for k in signature_changes(st['signature'], now)): return
    # (a tensor fits as this rank's shard or whole: a file of another layout is refused by the resume, naming it)
    shape = lambda t: {tuple(local_tensor(t).shape), tuple(t.shape)}
    model,sd = st.get('model'),unwrap(learn.model).state_dict()
    need(isinstance(model, dict), "'model' is not a dict")
    for k,v in model.items():
        need(k in sd and isinstance(v, torch.Tensor) and shape(v) & shape(sd[k]), f'the model tensor {k!r} does not fit this model')
    params,grads = list(unwrap(learn.model).parameters()),st.get('grads')
    need(isinstance(grads, list) and len(grads) == len(params), "'grads' does not fit this model's parameters")
    need(all(g is None or (isinstance(g, torch.Tensor) and shape(g) & shape(p)) for g,p in zip(grads, params)), 'a gradient does not fit its parameter')
    if learn.opt is not None and st.get('opt') is not None: _check_opt(st['opt'], learn.opt, need, shape, bool(st.get('sharded')))
    need(st.get('scaler') is None or isinstance(st['scaler'], dict), "'scaler' is not a dict")
    rec = st.get('recorder')
    need(isinstance(rec, dict) and set(rec) <= {*_RECORDER_KEYS, 'smooth', 'mets'} and isinstance(rec.get('smooth'), dict)
         and isinstance(rec.get('mets'), list) and all(isinstance(m, dict) for m in rec['mets']), "'recorder' is malformed")
    need(all(isinstance(rec.get(k, []), list) for k in _RECORDER_KEYS if k != 'losses'), "'recorder' is malformed")
    ls = rec.get('losses', [])
    need(isinstance(ls, list) or (isinstance(ls, torch.Tensor) and ls.ndim == 1), "'recorder' is malformed")
    need(declared_fits(learn.recorder.smooth_loss, rec['smooth']) and len(rec['mets']) <= len(train_metrics(learn.recorder))
         and all(declared_fits(m, d) for m,d in zip(train_metrics(learn.recorder), rec['mets'])), "'recorder' holds numbers that do not fit it")
    need(all(type(st.get(k, 0)) in (int, float) for k in ('pct_train', 'train_iter', 'opt_steps', 'iter_done')), 'a place number is malformed')
    need(st.get('ahead_device') is None or isinstance(st['ahead_device'], (torch.device, str)), "'ahead_device' is malformed")
    inner = learn.dls.train.__dict__.get('dl', learn.dls.train)
    for k,get,put in (('loader_rngs', loader_rngs, set_loader_rngs), ('loader_orders', loader_orders, set_loader_orders)):
        need(st.get(k) is None or isinstance(st[k], list), f'{k!r} is not a list')
        if k == 'loader_orders' and st.get(k) is not None:
            need(all(o is None or (isinstance(o, list) and all(type(i) is int for i in o)) for o in st[k]), f'{k!r} is malformed')
            need(all(o is None or n is None or len(o) == len(n) for o,n in zip(reversed(st[k]), reversed(get(inner)))), f'{k!r} does not fit the loader')
        _tried(lambda: get(inner), lambda v: put(inner, v), st.get(k), f"{where}: {k!r} cannot be applied to the training loader")
    for k in ('rngs', 'epoch_rngs'):
        if st.get(k) is None and k == 'epoch_rngs': continue
        _tried(rng_states, set_rng_states, st.get(k), f"{where}: {k!r} is not the RNGs' state")
    need(st.get('carried') is None or (isinstance(st['carried'], dict) and all(isinstance(d, dict) and (
         isinstance(d.get('attributes'), dict) or 'declared' in d) for d in st['carried'].values())), "'carried' is malformed")
    cbs = st.get('callbacks')
    need(isinstance(cbs, dict), "'callbacks' is not a dict")
    for k,cb,get,put in callback_states(learn, skip):
        if k not in cbs: continue
        own,attrs = get(),dict(vars(cb))
        try: put(cbs[k])
        except Exception as e: raise ValueError(f"{where}: the state of {k} cannot be applied ({type(e).__name__}: {str(e)[:120]})") from None
        finally:   # its own state again: by its protocol, and its attributes as they were (a flag `load_state_dict` sets)
            put(own)
            for a in set(vars(cb)) - set(attrs): delattr(cb, a)
            vars(cb).update(attrs)

def _tried(get, put, value, what:str):
    "`put(value)` tried, then what `get()` gave put back whatever happened; `ValueError(what)` where it could not be put"
    own = get()
    try: put(value)
    except Exception as e: raise ValueError(f"{what} ({type(e).__name__})") from None
    finally: put(own)

def _plain_value(v)->bool:
    "A hyper-parameter or option as torch's optimizers hold them: a number, a bool, None, a string, a tuple of numbers"
    return v is None or type(v) in (bool, int, float, str) or (
        type(v) in (tuple, list) and all(type(x) in (int, float) for x in v))

def _state_fits(d:dict, p, shape, sharded:bool)->bool:
    "One parameter's optimizer state: numbers, or tensors 0-d or of the parameter's shape"
    return all(type(k) is str and (v is None or type(v) in (bool, int, float) or (isinstance(v, torch.Tensor) and (
               sharded or v.ndim == 0 or shape(v) & shape(p)))) for k,v in d.items())

def _check_torch_opt(saved, opt, params, need, shape, sharded:bool):
    """torch's optimizer state (`OptimWrapper.state_dict`, which is its torch optimizer's): the parameter groups of
    `opt`'s, the same options, each parameter's index once, and each state of a parameter that is there"""
    need(set(saved) == {'state', 'param_groups'} and isinstance(saved['param_groups'], list)
         and isinstance(saved['state'], dict), "'opt' is not an optimizer's state (fastai's or torch's)")
    groups,now = saved['param_groups'],opt.state_dict()['param_groups']
    need(len(groups) == len(now) and all(isinstance(g, dict) and set(g) == set(n) for g,n in zip(groups, now)),
         "the optimizer's parameter groups do not fit this optimizer's (another optimizer, or other options)")
    idx = [i for g in groups for i in (g['params'] if isinstance(g['params'], list) else [None])]
    need(all(type(i) is int for i in idx) and sorted(idx) == list(range(len(params)))
         and [len(g['params']) for g in groups] == [len(n['params']) for n in now],
         "the optimizer's parameter groups do not fit its parameters")
    need(all(_plain_value(v) for g in groups for k,v in g.items() if k != 'params'),
         "the optimizer's options are malformed")
    st = saved['state']
    need(all(type(i) is int and 0 <= i < len(params) and isinstance(d, dict) for i,d in st.items()),
         "the optimizer's state does not fit its parameters")
    by_index = dict(zip([i for n in now for i in n['params']], params))
    for i,d in st.items():
        need(_state_fits(d, by_index[i], shape, sharded), f"the optimizer's state of parameter {i} does not fit it")
    _tried(opt.state_dict, opt.load_state_dict, saved, "the optimizer's state cannot be applied")

def _check_opt(saved, opt, need, shape, sharded:bool):
    """An optimizer's state as its `state_dict` writes it, for `opt`'s parameters and hyper-parameters: fastai's
    `Optimizer` (`state`, `hypers`) or torch's behind fastai's `OptimWrapper` (`state`, `param_groups`)"""
    params = [p for p,*_ in opt.all_params(with_grad=False)]
    torch_now = 'param_groups' in opt.state_dict()   # (the form this optimizer writes is the form it reads)
    need(isinstance(saved, dict) and ('param_groups' in saved) == torch_now,
         f"'opt' is not {'a torch' if torch_now else 'a fastai'} optimizer's state (another optimizer)")
    if torch_now: return _check_torch_opt(saved, opt, params, need, shape, sharded)
    need(set(saved) == {'state', 'hypers'}, "'opt' is not a fastai optimizer's state")
    from fastcore.foundation import L
    hypers,state = list(saved['hypers']) if isinstance(saved['hypers'], (list, tuple, L)) else None,saved['state']
    need(hypers is not None and len(hypers) == len(opt.hypers) and all(
         isinstance(h, dict) and set(h) == set(n) and all(type(v) in (int, float) for v in h.values()) for h,n in zip(hypers, opt.hypers)),
         "the optimizer's hyper-parameters do not fit its parameter groups")
    need(isinstance(state, (list, tuple)) and len(state) == len(params) and all(isinstance(d, dict) for d in state),
         "the optimizer's state does not fit its parameters")
    for d,p in zip(state, params):
        for k,v in d.items():
            ok = v is None or type(v) in (bool, int, float) or (isinstance(v, torch.Tensor) and (sharded or v.ndim == 0 or shape(v) & shape(p)))
            need(ok, f"the optimizer's state {k!r} does not fit its parameter")

# -- what a resumed fit must share with the checkpoint's ------------------------------------------------------------------
def fit_signature(learn, n_fit:int, fit_args:dict, loader:dict)->dict:
    """What a resumed fit must share with the checkpoint's to continue it exactly (each is named where it differs): the
    fit's number in the session, its epochs, the processes and the loader (`loader`: `world_size.loader_signature`'s),
    the data, what the callbacks declare (`ResumeSignature`: the window, the micro-batches, BatchNorm's mode), the
    model's shapes, the fit's arguments"""
    return {'fit': n_fit, 'n_epoch': learn.n_epoch, **loader, 'data': data_identity(learn.dls.train), **resume_signatures(learn),
            'model': [(k, tuple(v.shape)) for k,v in unwrap(learn.model).state_dict().items()], **fit_args}

def _fingerprint_bytes(x)->bytes:
    if isinstance(x, torch.Tensor): return x.detach().cpu().contiguous().numpy().tobytes() if x.numel() <= 1<<16 else repr(x.shape).encode()
    if isinstance(x, (list, tuple)): return b'|'.join(_fingerprint_bytes(v) for v in x)
    return repr(x).encode()

def data_identity(dl)->str:
    """The training data's identity: its number of items and a CRC-32 of five of its raw items (the first three, the
    middle and the last: a file's path, a row, a tensor), the same on any number of processes. Two notebooks sharing a
    checkpoint folder with other data of the same shapes no longer resume each other's weights"""
    import zlib
    dl = dl.__dict__.get('dl', dl)
    ds = getattr(dl, 'dataset', None)
    items = getattr(ds, 'items', None) if ds is not None else None
    seq = items if items is not None else ds
    try:
        n = len(seq)
        pick = lambda i: seq.iloc[i] if hasattr(seq, 'iloc') else seq[i]
        crc = zlib.crc32(b'#'.join(_fingerprint_bytes(pick(i)) for i in sorted({0, 1, 2, n//2, n - 1}) if 0 <= i < n))
    except Exception: return f'{getattr(dl, "n", None)} items'
    return f'{n} items, CRC-32 {crc:08x}'
