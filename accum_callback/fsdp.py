"""fastai + FSDP2 (`torch.distributed.fsdp.fully_shard`): a way in (`learn.to_fsdp`, `learn.from_fsdp`,
`learn.fsdp_ctx`) and, on a Learner whose model is sharded, `save`/`load`/`export` that write and read the whole model,
not one rank's shard: set on that Learner by `to_fsdp` (or `learn.fsdp_checkpoints()` for a model sharded by hand),
never on fastai's `Learner` class, whose methods stay fastai's.

`GradientAccumulation` accumulates under FSDP2 whoever sharded the model (one reduce-scatter per window; see
`window/accumulate.py` and `core/distributed.py`); this module is the fastai side: sharding `learn.model` block by
block, the optimizer rebuilt on the sharded parameters, the data cut per rank with fastai's `DistributedDL`, and the
checkpoints."""
from __future__ import annotations
import contextlib, copy, functools, gc, os, pickle, types, warnings

import torch, torch.nn as nn
import torch.distributed as dist
from fastai.learner import Learner
from fastcore.basics import patch

from .batchnorm.callback import BatchNormAccumulation
from .resume.format import from_plain, plain_state
from .compat.torch import tree_map
from .core.distributed import FSDPOptions, gloo_distributed_dl, is_fsdp, unwrap
from .micro import copy_module

__all__ = ['default_blocks', 'fsdp_full_state_dict', 'FSDPState']

def default_blocks(model:nn.Module)->list:
    """The blocks `to_fsdp` shards by default: modules that sit in an `nn.Sequential` or `nn.ModuleList` beside a
    sibling of the same class and hold parameters (ResNet's BasicBlock/Bottleneck, ConvNeXt and ViT blocks), the
    outermost ones"""
    found,taken = [],set()
    def walk(m):
        for c in m.children():
            if id(c) in taken: continue
            if isinstance(m, (nn.Sequential, nn.ModuleList)) and any(type(s) is type(c) and s is not c
                                                                     for s in m.children()) \
               and any(True for _ in c.parameters()):
                found.append(c); taken.update(id(x) for x in c.modules())
            else: walk(c)
    walk(model)
    return found

def _meta_template(model:nn.Module)->nn.Module:
    "An unsharded copy of `model`'s architecture with no storage (meta tensors): what `export`/`from_fsdp` fill again"
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device='meta'), t.requires_grad) if isinstance(t, nn.Parameter)
                    else torch.empty_like(t, device='meta'))
            for t in list(model.parameters()) + list(model.buffers())}
    return copy_module(model, memo, computed=lambda t: torch.empty_like(t, device='meta'))

class FSDPState:
    """What `to_fsdp` changed on a Learner, to put back: the loaders, the unsharded template, whether it started the
    group"""
    def __init__(self, template, dls_loaders, device, own_group):
        self.template,self.dls_loaders,self.device,self.own_group = template,dls_loaders,device,own_group
        self.dl_patch = contextlib.ExitStack()

def _init_group():
    "Start the default process group from torchrun's environment (NCCL with a GPU, gloo without); True if started here"
    if dist.is_initialized(): return False
    if 'RANK' not in os.environ or 'WORLD_SIZE' not in os.environ:
        raise RuntimeError("to_fsdp: no process group and no torchrun environment (RANK, WORLD_SIZE): launch with "
                           "`torchrun --nproc_per_node=N script.py` (see docs/distributed.md), or init the group first")
    if torch.cuda.is_available(): torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', 0)))
    dist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo')
    return True

@patch
def to_fsdp(self:Learner,
    blocks=None, # modules (or a function of the model giving them) to shard each on its own; default `default_blocks`
    mesh=None, # a `DeviceMesh`; default one dimension over every rank, on this rank's GPU or the CPU
    shard_data:bool=True, # cut the training and validation loaders per rank with fastai's `DistributedDL`
    # accumulating: reduce-scatter every micro-batch so gradients stay sharded (1/world the memory, k rounds a window)
    sharded_grads:bool=False,
    # accumulating: keep parameters gathered through a window (one all-gather a window, not 1-2 a micro-batch)
    gathered_params:bool=False,
    **kwargs # passed to `fully_shard` (e.g. `reshard_after_forward`, `mp_policy`)
):
    """Shard `learn.model` with FSDP2 block by block, then its root; rebuild the optimizer on the sharded parameters;
    cut the data per rank. A `BatchNormAccumulation('groupnorm'/'renorm')` on the Learner converts the model first (a
    sharded model cannot be converted). Launch with `torchrun`; `learn.from_fsdp()` puts everything back"""
    try: from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise ImportError("learn.to_fsdp needs FSDP2 (`torch.distributed.fsdp.fully_shard`, public from torch 2.6), "
                          f"which torch {torch.__version__} does not have; accum_callback's FSDP2 is tested from torch "
                          "2.14 (docs/versions.md). Use DDP (`learn.distrib_ctx()`) or a newer torch") from None
    from torch.distributed.device_mesh import init_device_mesh
    from fastai.distributed import DistributedDL
    if getattr(self, 'fsdp_state', None) is not None: raise ValueError("to_fsdp: the Learner is sharded already")
    opts = FSDPOptions(sharded_grads, gathered_params)   # (checked before anything is touched)
    own = _init_group()
    model = unwrap(self.model)
    if is_fsdp(model): raise ValueError("to_fsdp: the model is sharded already (by `fully_shard`); use it as it is")
    bna = next((cb for cb in self.cbs if isinstance(cb, BatchNormAccumulation)), None)
    if bna is not None: model = bna.convert(model)
    dev = torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else torch.device('cpu')
    model = model.to(dev)
    if mesh is None: mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    template = _meta_template(model)
    bs = blocks(model) if callable(blocks) else (default_blocks(model) if blocks is None else list(blocks))
    for b in bs: fully_shard(b, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    self.model = model
    st = self.fsdp_state = FSDPState(template, list(self.dls.loaders), dev, own)
    if shard_data:
        if dist.get_backend() != 'nccl': st.dl_patch.enter_context(gloo_distributed_dl())
        self.dls.loaders = [dl if isinstance(dl, DistributedDL) else DistributedDL(dl) for dl in self.dls.loaders]
    self.create_opt()   # on the sharded (DTensor) parameters
    self.fsdp_options = opts   # (what `GradientAccumulation` reads at fit start)
    return self.fsdp_checkpoints()

@patch
def fsdp_checkpoints(self:Learner):
    """This Learner's `save`, `load` and `export` write and read the whole model (gathered from every rank's shard)
    while its model is sharded with FSDP2, fastai's otherwise; set by `to_fsdp`, and for a model sharded by hand
    (`fully_shard`) call it once. Only this Learner changes: fastai's `Learner` class keeps its methods"""
    for k,f in _CHECKPOINTS.items(): self.__dict__[k] = types.MethodType(f, self)
    return self

def _fastai_checkpoints(learn):
    "fastai's own `save`, `load` and `export` on `learn` again"
    for k in _CHECKPOINTS: learn.__dict__.pop(k, None)

def fsdp_full_state_dict(model)->dict:
    "The whole model's state dict, gathered from every rank (a collective: every rank calls it), on the CPU of rank 0"
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

def _unsharded(template, sd, device='cpu')->nn.Module:
    m = copy.deepcopy(template).to_empty(device=device)
    m.load_state_dict(sd)
    return m

@patch
def from_fsdp(self:Learner,
    device=None, # where the unsharded model goes (default: where `to_fsdp` put the sharded one)
):
    """Undo `to_fsdp`: `learn.model` is the whole (unsharded) model again on every rank, the loaders and optimizer
    fastai's"""
    st = getattr(self, 'fsdp_state', None)
    if st is None: raise ValueError("from_fsdp: the Learner was not sharded with `learn.to_fsdp()`")
    sd = fsdp_full_state_dict(self.model)
    obj = [sd if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)   # rank 0 holds the gathered weights
    self.model = _unsharded(st.template, obj[0], device or st.device)
    self.dls.loaders = st.dls_loaders
    st.dl_patch.close()
    self.fsdp_state = self.fsdp_options = None
    _fastai_checkpoints(self)
    self.create_opt()
    if st.own_group:
        del st, sd, obj
        gc.collect()   # the sharded modules (in reference cycles) hold the group: free them before it goes
        dist.destroy_process_group()
    return self

@patch
@contextlib.contextmanager
def fsdp_ctx(self:Learner, blocks=None, mesh=None, shard_data:bool=True, sharded_grads:bool=False,
             gathered_params:bool=False, **kwargs):
    """`to_fsdp` for the block, `from_fsdp` after it: fastai's `distrib_ctx`, with FSDP2. After an error the weights are
    not gathered (a gather is a collective, and the other ranks may still be training, or gone): the error is raised as
    it was, on the rank where it happened, with the loaders put back and the model left sharded"""
    self.to_fsdp(blocks=blocks, mesh=mesh, shard_data=shard_data, sharded_grads=sharded_grads,
                 gathered_params=gathered_params, **kwargs)
    try: yield self
    except BaseException:
        _leave_fsdp_locally(self)
        raise
    self.from_fsdp()

def _leave_fsdp_locally(learn):
    """What `from_fsdp` undoes that needs no other rank: the loaders (and fastai's DistributedDL patch); the model stays
    sharded"""
    st = getattr(learn, 'fsdp_state', None)
    if st is None: return
    learn.dls.loaders = st.dls_loaders
    st.dl_patch.close()
    learn.fsdp_state = learn.fsdp_options = None

# -- fastai's save / load / export under FSDP2
# ------------------------------------------------------------------------------
_fastai_save,_fastai_load,_fastai_export = Learner.save,Learner.load,Learner.export   # (read, never replaced)

def _full(t):
    "A DTensor gathered whole on the CPU (a collective), anything else as it is"
    return t.full_tensor().cpu() if hasattr(t, 'full_tensor') else t

def _opt_states(opt)->list:
    "(parameter, state dict) pairs of a fastai `Optimizer` or `OptimWrapper`"
    inner = getattr(opt, 'opt', None)
    if inner is not None and isinstance(getattr(inner, 'state', None), dict):
        return [(p, s) for p,s in inner.state.items()]
    return [(p, opt.state[p]) for p,*_ in opt.all_params() if p in opt.state]

@functools.wraps(_fastai_save)
def _save(self, file, with_opt=True, pickle_protocol=2, **kwargs):
    if not is_fsdp(self.model):
        return _fastai_save(self, file, with_opt=with_opt, pickle_protocol=pickle_protocol, **kwargs)
    from fastcore.xtras import join_path_file
    file = join_path_file(file, self.path/self.model_dir, ext='.pth')
    state = fsdp_full_state_dict(self.model)   # every rank takes part in the gathers
    if with_opt and getattr(self, 'opt', None) is not None:
        state = {'model': state, 'opt': tree_map(_full, self.opt.state_dict())}
    # (read back without running code)
    if dist.get_rank() == 0:
        torch.save(plain_state(state, 'the FSDP2 state'), file, pickle_protocol=pickle_protocol, **kwargs)
    dist.barrier()
    return file

@functools.wraps(_fastai_load)
def _load(self, file, device=None, with_opt=True, strict=True, **kwargs):
    if not is_fsdp(self.model):
        return _fastai_load(self, file, device=device, with_opt=with_opt, strict=strict, **kwargs)
    from fastcore.xtras import join_path_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, StateDictOptions
    from torch.distributed.tensor import distribute_tensor
    if self.opt is None: self.create_opt()
    file = join_path_file(file, self.path/self.model_dir, ext='.pth')
    dist.barrier()
    # every rank reads the whole file (a shared disk); runs no code
    try: state = from_plain(torch.load(file, map_location='cpu', weights_only=True))
    except pickle.UnpicklingError:
        raise ValueError(f"learn.load: {file} holds objects that a file read without running code cannot hold (saved "
                         "by accum_callback before 0.3.0, or not by `learn.save`); if you trust it, read it with "
                         "`torch.load(file, weights_only=False)` on one process and save it again with "
                         "`learn.save`") from None
    has_opt = set(state) == {'model', 'opt'}
    set_model_state_dict(self.model, state['model'] if has_opt else state,
                         options=StateDictOptions(full_state_dict=True, strict=strict))
    if has_opt and with_opt:
        self.opt.load_state_dict(state['opt'])
        for p,s in _opt_states(self.opt):   # whole tensors back into this rank's shard of each parameter's layout
            if not hasattr(p, 'device_mesh'): continue
            for k,v in list(s.items()):
                if isinstance(v, torch.Tensor) and not hasattr(v, 'device_mesh') and tuple(v.shape) == tuple(p.shape):
                    s[k] = distribute_tensor(v.to(p.to_local().device), p.device_mesh, p.placements, src_data_rank=None)
    elif with_opt: warnings.warn("Saved file doesn't contain an optimizer state.")
    return self

@functools.wraps(_fastai_export)
def _export(self, fname='export.pkl', **kwargs):
    if not is_fsdp(self.model):
        # the exported Learner is fastai's
        mine = {k: self.__dict__.pop(k) for k in _CHECKPOINTS if k in self.__dict__}
        try: return _fastai_export(self, fname, **kwargs)
        finally: self.__dict__.update(mine)
    st = getattr(self, 'fsdp_state', None)
    if st is None:
        raise ValueError("learn.export under FSDP2 needs the unsharded architecture: shard with `learn.to_fsdp()` "
                         "(which keeps it), or build the model again unsharded and load `learn.save(...)`'s file into "
                         "it")
    sd = fsdp_full_state_dict(self.model)   # every rank takes part; rank 0 writes
    err = None
    if dist.get_rank() == 0:
        model,opt,loaders = self.model,self.opt,self.dls.loaders
        self.model,self.opt,self.dls.loaders = _unsharded(st.template, sd, 'cpu'),None,st.dls_loaders
        fsdp_state,self.fsdp_state = self.fsdp_state,None
        # the exported Learner is fastai's
        mine = {k: self.__dict__.pop(k) for k in _CHECKPOINTS if k in self.__dict__}
        try:
            with _as_rank0(): _fastai_export(self, fname, **kwargs)
        except Exception as e: err = f'{type(e).__name__}: {e}'
        finally:
            self.model,self.opt,self.dls.loaders,self.fsdp_state = model,opt,loaders,fsdp_state
            self.__dict__.update(mine)
    res = [err]
    dist.broadcast_object_list(res, src=0)   # every rank ends alike: done, or the same error
    if res[0] is not None: raise RuntimeError(f"learn.export under FSDP2 failed on rank 0: {res[0]}")

@contextlib.contextmanager
def _as_rank0():
    "fastai's export writes only where `RANK` is 0 or unset"
    old = os.environ.get('RANK')
    os.environ['RANK'] = '0'
    try: yield
    finally:
        if old is None: os.environ.pop('RANK', None)
        else: os.environ['RANK'] = old

_CHECKPOINTS = dict(save=_save, load=_load, export=_export)
