"""Every torch name outside torch's public API that the library uses, in one place, each found by what this torch has
(never by its version number), with a fallback or a clear refusal naming the torch version and the feature where it
is gone. docs/versions.md lists them with what each is for; `tests/test_package.py` fails when another module reaches
for a private torch name itself."""
from __future__ import annotations

import contextlib
import torch, torch.nn as nn

__all__ = ['foreach', 'tree_flatten', 'tree_unflatten', 'tree_map', 'BatchNormBase', 'module_dicts', 'OutOfMemoryError',
           'autocast_enabled', 'compiled_with_cuda_graphs', 'is_compiled', 'fsdp_param_groups', 'fsdp_grads_reachable',
           'held_unsharded_grad', 'clear_held_grads', 'local_tensor', 'grad_scale', 'run_eagerly', 'rng_states',
           'set_rng_states', 'rngs_kept', 'TORCH']

TORCH = torch.__version__

# -- fused multi-tensor ops: torch._foreach_* -------------------------------------------------------------------------
def _loop(name:str):
    "The per-tensor equivalent of `torch._foreach_<name>` (a list, or one value for every tensor, per argument)"
    def f(ts, *args):
        args = [a if isinstance(a, (list, tuple)) else [a]*len(ts) for a in args]
        out = [getattr(t, name)(*xs) for t,*xs in zip(ts, *args)]
        return None if name.endswith('_') else out
    f.__name__ = f'_foreach_{name}'
    return f

def foreach(name:str):
    """`torch._foreach_<name>` (one fused kernel for a list of tensors: `mul_`, `copy_`, `add_`, `norm`, ...), or the
    same as a loop over the tensors where this torch has none"""
    return getattr(torch, f'_foreach_{name}', None) or _loop(name)

# -- nested containers of tensors (instead of torch.utils._pytree) ---------------------------------------------------
def tree_flatten(obj)->tuple[list, object]:
    """The leaves of `obj` (inside lists, tuples, namedtuples and dicts, in order) and how to put them back
    (`tree_unflatten`)"""
    if isinstance(obj, dict): keys,kids = list(obj),list(obj.values())
    elif isinstance(obj, (list, tuple)): keys,kids = None,list(obj)
    else: return [obj],None
    parts = [tree_flatten(o) for o in kids]
    kind = (type(obj), getattr(obj, 'default_factory', None))   # (a defaultdict keeps its factory)
    return [l for ls,_ in parts for l in ls],(kind, keys, [s for _,s in parts], [len(ls) for ls,_ in parts])

def tree_unflatten(leaves, spec):
    if spec is None: return leaves[0]
    (kind,factory),keys,specs,sizes = spec
    out,i = [],0
    for s,k in zip(specs, sizes): out.append(tree_unflatten(leaves[i:i+k], s)); i += k
    if keys is not None:
        d = kind(factory) if factory is not None else kind()
        d.update(zip(keys, out)); return d
    return kind(*out) if hasattr(kind, '_fields') else kind(out)   # a namedtuple takes its fields as arguments

def tree_map(f, obj):
    "`f` applied to every leaf of `obj`, the containers rebuilt"
    leaves,spec = tree_flatten(obj)
    return tree_unflatten([f(l) for l in leaves], spec)

# -- BatchNorm's base class, the CUDA out-of-memory error, autocast
# -----------------------------------------------------
BatchNormBase = getattr(nn.modules.batchnorm, '_BatchNorm', None)   # BatchNorm1d/2d/3d, SyncBatchNorm, timm's norm-act
if BatchNormBase is None:
    raise ImportError("accum_callback needs torch.nn.modules.batchnorm._BatchNorm (the base of every BatchNorm "
                      f"layer), which torch {TORCH} does not have: please report it")

def module_dicts(m:nn.Module)->tuple[dict,dict]:
    """(`m._buffers`, `m._modules`): nn.Module's own storage of its buffers and children. 'pool' swaps a BatchNorm's
    buffers per micro-batch through the dict (`Module.__setattr__` costs more than the rest of its hook) and the
    converters replace children through it (`named_children` skips a module's second name)"""
    return m._buffers,m._modules

if not all(isinstance(d, dict) for d in module_dicts(nn.Module())):
    raise ImportError(f"accum_callback needs nn.Module's `_buffers` and `_modules` dicts, which torch {TORCH} does not "
                      "have: please report it")

OutOfMemoryError = getattr(torch, 'OutOfMemoryError', None) or torch.cuda.OutOfMemoryError

def autocast_enabled(device_type:str)->bool:
    "Is autocast on for `device_type` ('cuda' or 'cpu')?"
    try: return torch.is_autocast_enabled(device_type)
    except TypeError:   # torches that ask per device with another function
        return torch.is_autocast_enabled() if device_type == 'cuda' else torch.is_autocast_cpu_enabled()

def local_tensor(t:torch.Tensor)->torch.Tensor:
    "A DTensor's local shard (FSDP2's sharded parameters and gradients), any other tensor itself"
    return t.to_local() if hasattr(t, 'to_local') else t

def grad_scale(learn):
    """The factor fastai's fp16 `MixedPrecision` multiplies the gradients by (its `GradScaler`'s scale), as a tensor on
    the device where the scaler keeps it (`_scale`: no host synchronisation), else its public `get_scale()`; None
    without a scaler or with one that is off (bf16)"""
    s = getattr(learn, 'scaler', None)
    if s is None or not getattr(s, 'is_enabled', lambda: False)(): return None
    t = getattr(s, '_scale', None)
    return t.double() if isinstance(t, torch.Tensor) else torch.tensor(float(s.get_scale()), dtype=torch.float64)

# -- torch.compile: is any part of the model compiled (with CUDA graphs)?
# ------------------------------------------------
def is_compiled(model:nn.Module)->bool:
    """Is any part of `model` compiled: a `torch.compile` wrapper (`_orig_mod`) or a module compiled in place
    (`.compile()`)"""
    return any(hasattr(m, '_orig_mod') or getattr(m, '_compiled_call_impl', None) is not None for m in model.modules())

@contextlib.contextmanager
def run_eagerly(model:nn.Module):
    """Every compiled part of `model` run eagerly within (a `torch.compile` wrapper's `forward`, a module compiled in
    place): the recomputation's forwards change modes, momenta and hooks, which a compiled graph would guard on and
    compile again for (torch 2.4's dynamo failed on them: 'DictGuardManager does not support a leaf_guard')"""
    wrapped = [(m, m.__dict__.get('forward')) for m in model.modules() if hasattr(m, '_orig_mod')]
    in_place = [(m, m._compiled_call_impl) for m in model.modules()
                if getattr(m, '_compiled_call_impl', None) is not None]
    for m,_ in wrapped: m.__dict__['forward'] = m._orig_mod.__call__
    for m,_ in in_place: m._compiled_call_impl = None
    try: yield
    finally:
        for m,f in wrapped:
            if f is None: m.__dict__.pop('forward', None)
            else: m.__dict__['forward'] = f
        for m,f in in_place: m._compiled_call_impl = f

def compiled_with_cuda_graphs(model:nn.Module)->bool:
    """Is any part of `model` a `torch.compile` module whose backend records CUDA graphs (mode='reduce-overhead' or
    'max-autotune')? Read from dynamo's wrappers (`_orig_mod`, `dynamo_ctx.callback`, `_torchdynamo_orig_backend`, the
    inductor options): where a torch lays them out otherwise, False (the refusal it feeds is not made)"""
    for m in model.modules():
        if not hasattr(m, '_orig_mod'): continue
        f = getattr(getattr(m, 'dynamo_ctx', None), 'callback', None)
        for _ in range(8):   # CatchErrorsWrapper -> ConvertFrame -> backend wrapper with the inductor options
            if f is None: break
            cfg = getattr(f, 'config', None)
            if isinstance(cfg, dict) and cfg.get('triton.cudagraphs'): return True
            f = getattr(f, '_torchdynamo_orig_backend', None)
    return False

# -- FSDP2's per-parameter records
# ----------------------------------------------------------------------------------------
def _fsdp_state(module):
    get = getattr(module, '_get_fsdp_state', None)
    return get() if callable(get) else None

def fsdp_param_groups(module)->list|None:
    """FSDP2's parameter groups of one sharded module: `_get_fsdp_state()._fsdp_param_groups` (a list, torch 2.14), or
    its one `_fsdp_param_group` (torch 2.6); None where neither is there"""
    st = _fsdp_state(module)
    groups = getattr(st, '_fsdp_param_groups', None)
    if groups is not None: return list(groups)
    if st is not None and hasattr(st, '_fsdp_param_group'):
        g = st._fsdp_param_group
        return [] if g is None else [g]
    return None

def fsdp_grads_reachable(modules:list)->bool:
    """Can the gradients FSDP2 holds unsharded for these sharded modules be reached (to discard them when a window
    drops)?"""
    for m in modules:
        groups = fsdp_param_groups(m)
        if groups is None or any(not hasattr(g, 'fsdp_params') for g in groups): return False
    return True

def _settable(obj, name:str)->bool:
    "A plain attribute (torch 2.14's `FSDPParam.unsharded_accumulated_grad`), not a read-only property (torch 2.15's)"
    prop = getattr(type(obj), name, None)
    return not isinstance(prop, property) or prop.fset is not None

def held_unsharded_grad(fp):
    """The gradient FSDP2 holds unsharded for one parameter between backward passes without sync: the reduce-dtype
    accumulator where this torch keeps one apart (2.14), else the unsharded parameter's `.grad`"""
    g = getattr(fp, 'unsharded_accumulated_grad', None) if _settable(fp, 'unsharded_accumulated_grad') else None
    if g is None:
        up = fp.__dict__.get('_unsharded_param')   # (the `unsharded_param` property asserts it exists)
        g = up.grad if up is not None else None
    return g

def clear_held_grads(fp):
    "Drop what `held_unsharded_grad` finds (where it is read-only, it is the parameter's `.grad`, dropped below)"
    if _settable(fp, 'unsharded_accumulated_grad') and getattr(fp, 'unsharded_accumulated_grad', None) is not None:
        fp.unsharded_accumulated_grad = None
    up = fp.__dict__.get('_unsharded_param')
    if up is not None and up.grad is not None: up.grad = None

def rng_states()->tuple:
    """Every global RNG's state: torch's CPU and CUDA (once CUDA is in use: reading it would start CUDA in a process
    that has not, and a process forked after that cannot use CUDA), Python's, numpy's"""
    import random, numpy as np
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available()
            and torch.cuda.is_initialized() else None,
            random.getstate(), np.random.get_state())

def set_rng_states(saved:tuple):
    "Put back what `rng_states()` took"
    import random, numpy as np
    torch.set_rng_state(saved[0])
    if saved[1] is not None: torch.cuda.set_rng_state_all(saved[1])
    random.setstate(saved[2]); np.random.set_state(saved[3])

@contextlib.contextmanager
def rngs_kept():
    "Every RNG (torch's CPU and CUDA, Python's, numpy's) as it was, after the block"
    saved = rng_states()
    try: yield
    finally: set_rng_states(saved)
