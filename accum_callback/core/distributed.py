"""What the ranks agree on, under DDP and FSDP2: the no-sync rule (only the micro-batch that steps all-reduces or
reduce-scatters), window totals summed over ranks, SyncBatchNorm's global counts, FSDP2's held unsharded gradients;
`count_allreduces` / `count_collectives` to check the rule, and fastai's DDP path on CPU (gloo)"""
import contextlib, sys
from dataclasses import dataclass

import torch, torch.nn as nn
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from .args import flag
from ..compat.torch import (TORCH, clear_held_grads, foreach, fsdp_grads_reachable, fsdp_param_groups,
                            held_unsharded_grad)

__all__ = ['SyncPolicy', 'FSDPOptions', 'is_ddp', 'is_fsdp', 'is_distributed', 'unwrap', 'world_size', 'process_rank',
           'process_count', 'enter_no_sync', 'sum_over_ranks', 'reduce_floats',
           'all_reduce_grads', 'fsdp_modules', 'fsdp_params', 'check_fsdp', 'discard_unsharded_grads',
           'held_grad_bytes',
           'set_resharding', 'zero_grads', 'fsdp_group_count',
           'sync_batchnorm_world', 'AllReduceCounter', 'count_allreduces', 'CollectiveCounter', 'count_collectives',
           'gloo_distributed_dl']

def is_ddp(model)->bool: return isinstance(model, DistributedDataParallel)

def _fsdp(name:str):
    """`torch.distributed.fsdp.<name>` if something has loaded torch's FSDP package, else None: a model can only be
    sharded once it is loaded, and a plain fit should not load it (about 60 MiB of peak memory with DTensor)"""
    return getattr(sys.modules.get('torch.distributed.fsdp'), name, None)

def is_fsdp(model)->bool:
    "Is `model` sharded with FSDP2's `fully_shard` (its root, as FSDP2 asks), by whoever sharded it?"
    c = _fsdp('FSDPModule')
    return c is not None and isinstance(unwrap(model), c)

def is_distributed(model)->bool:
    "DDP or FSDP2: gradients are reduced over ranks"; return is_ddp(model) or is_fsdp(model)

def fsdp_modules(model)->list:
    "The FSDP2-sharded modules of `model` (FSDPModule instances), root first"
    c = _fsdp('FSDPModule')
    return [] if c is None else [m for m in unwrap(model).modules() if isinstance(m, c)]

def check_fsdp(model):
    "Refuse sharding setups whose gradients we cannot hold or sum correctly, with the way that works"
    FSDP1 = _fsdp('FullyShardedDataParallel')
    if FSDP1 is not None and any(isinstance(m, FSDP1) for m in unwrap(model).modules()):
        raise ValueError("GradientAccumulation: the model is wrapped in FSDP1 (`FullyShardedDataParallel`, e.g. by "
                         "Accelerate's FSDP plugin through fastai's `distrib_ctx`), whose accumulation we do not "
                         "support. Shard it with FSDP2 instead: `learn.to_fsdp()` (or `learn.fsdp_ctx()`), see "
                         "docs/distributed.md")
    if is_fsdp(model) and not fsdp_grads_reachable(fsdp_modules(model)):
        raise ValueError("GradientAccumulation under FSDP2 discards the gradients FSDP2 holds unsharded when a window "
                         f"ends without a step, and torch {TORCH} keeps them where accum_callback does not reach them "
                         "(FSDPModule._get_fsdp_state()._fsdp_param_groups): use DDP or a torch of the tested range "
                         "(docs/versions.md), and please report it")
    if not is_fsdp(model) and fsdp_modules(model):
        raise ValueError("GradientAccumulation: parts of the model are sharded with FSDP2's `fully_shard` but not its "
                         "root: call `fully_shard(model)` after its blocks (FSDP2's own advice), or use "
                         "`learn.to_fsdp()`")

def unwrap(model):
    "The module inside DDP / DataParallel (the model itself otherwise)"
    return model.module if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model

def process_rank()->int:
    "This process's rank in the default process group (0 without one)"
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
def process_count()->int:
    "Processes in the default process group (1 without one)"
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

def world_size(model)->int:
    "Ranks a DDP or FSDP2 `model` averages its gradients over (1 otherwise)"
    return dist.get_world_size() if is_distributed(model) else 1

class _GradSync:
    "FSDP2's no-sync: gradients held unsharded (no reduce-scatter) until `exit`"
    def __init__(self, model): self.model = model; model.set_requires_gradient_sync(False)
    def __exit__(self, *a): self.model.set_requires_gradient_sync(True)

def enter_no_sync(model):
    """A micro-batch that does not step accumulates locally, without a collective: enter DDP's `no_sync()`, or turn off
    FSDP2's gradient sync (the gradients stay unsharded until the window's last backward reduce-scatters them). Returns
    the open context for `exit_no_sync`; None when `model` is neither"""
    if is_fsdp(model): return _GradSync(unwrap(model))
    if not is_ddp(model): return None
    ctx = model.no_sync(); ctx.__enter__()
    return ctx

def exit_no_sync(ctx):
    if ctx is not None: ctx.__exit__(None, None, None)

@dataclass
class FSDPOptions:
    """How a window meets FSDP2 (docs/distributed.md): `sharded_grads` reduce-scatters every micro-batch (gradients stay
    sharded: 1/world the memory, k rounds a window); `gathered_params` keeps the parameters gathered from a window's
    first forward to its last backward (one all-gather a window). `learn.to_fsdp(...)`/`learn.fsdp_ctx(...)` set them as
    `learn.fsdp_options`; for a model sharded by hand, set `learn.fsdp_options = FSDPOptions(...)`"""
    sharded_grads: bool = False
    gathered_params: bool = False
    def __post_init__(self):
        self.sharded_grads = flag(self.sharded_grads, 'sharded_grads')
        self.gathered_params = flag(self.gathered_params, 'gathered_params')

class SyncPolicy:
    """How a window's gradients meet over the ranks (docs/distributed.md): a micro-batch that does not step accumulates
    locally (DDP's `no_sync`, FSDP2's gradient sync off) and the one that steps reduces, as the Learner's `FSDPOptions`
    say (`learn.fsdp_options`, read at fit start). `manual` (the ranks retry micro-batches, `MicroBatching('auto')`):
    none syncs, the window is all-reduced once the ranks agree"""
    def __init__(self): self.options = FSDPOptions()
    def options_for(self, learn)->FSDPOptions:
        "The options a fit of `learn` runs with: the Learner's `fsdp_options`"
        opts = getattr(learn, 'fsdp_options', None)
        return opts if isinstance(opts, FSDPOptions) else FSDPOptions()
    def fit_starts(self, learn): "A fit starts: its options"; self.options = self.options_for(learn)
    @property
    def sharded_grads(self)->bool: return self.options.sharded_grads
    @property
    def gathered_params(self)->bool: return self.options.gathered_params

    def micro_starts(self, model, action, manual:bool):
        """A micro-batch starts whose unit `action` closes the window ('step', 'drop') or not (None): the no-sync
        context to exit after its backward"""
        fsdp = is_fsdp(model)
        ctx = enter_no_sync(model) if (action != 'step' or manual) and not (self.sharded_grads and fsdp) else None
        if fsdp and self.gathered_params: set_resharding(model, forward=False, backward=action is not None)
        return ctx

    def reduce(self, model, opt, manual:bool)->int:
        "The window's gradients over the ranks before its step; returns how many ranks they are averaged over (to undo)"
        if not manual: return world_size(model)   # DDP / FSDP2 averaged them in the closing backward
        all_reduce_grads([p for p,*_ in opt.all_params()])   # (a sum: none ran in sync)
        return 1

    def train_ends(self, model):
        "Training of an epoch ends: parameters kept gathered are resharded"
        if self.gathered_params and is_fsdp(model): set_resharding(model, True, True, now=True)

    def zero(self, model, opt=None):
        "Zero a window's gradients (FSDP2's held ones too; parameters kept gathered are resharded)"
        zero_grads(model, opt, reshard=self.gathered_params)

def fsdp_params(model):
    "FSDP2's per-parameter records of every sharded module of `model` (torch internals, reached through `compat`)"
    for m in fsdp_modules(model):
        for g in fsdp_param_groups(m) or []: yield from g.fsdp_params

def discard_unsharded_grads(model):
    """Drop the gradients FSDP2 holds unsharded between backward passes without sync (where the optimizer's
    `zero_grad` does not reach): a window that ends without its step must not leak into the next"""
    for fp in fsdp_params(model): clear_held_grads(fp)

def zero_grads(model, opt=None, reshard:bool=False):
    """Zero the gradients of `model` (through `opt` where there is one), those FSDP2 holds unsharded between backward
    passes too; `reshard`: FSDP2's parameters kept gathered through a window are resharded"""
    if is_fsdp(model):
        discard_unsharded_grads(model)
        if reshard: set_resharding(model, True, True, now=True)
    if opt is not None: opt.zero_grad()
    else:
        for p in model.parameters():
            if p.grad is not None: p.grad.detach_(); p.grad.zero_()

def set_resharding(model, forward:bool, backward:bool, now:bool=False):
    "FSDP2: whether parameters are freed (resharded) after each forward / backward; `now`: reshard them at once"
    m = unwrap(model)
    m.set_reshard_after_forward(forward); m.set_reshard_after_backward(backward)
    if now:
        for x in fsdp_modules(m): x.reshard()

def fsdp_group_count(model)->int:
    "FSDP2 parameter groups of `model`: each reduce-scatters once in a synchronised backward (a round)"
    return sum(len(fsdp_param_groups(m) or []) for m in fsdp_modules(model))

def held_grad_bytes(model)->tuple[int,int]:
    "(unsharded, sharded) gradient bytes FSDP2's parameters hold on this rank now"
    u = s = 0
    for fp in fsdp_params(model):
        g = held_unsharded_grad(fp)
        if g is not None: u += g.numel()*g.element_size()
        sg = getattr(getattr(fp, 'sharded_param', None), 'grad', None)
        if sg is not None: sg = _local(sg); s += sg.numel()*sg.element_size()
    return u,s

def sum_over_ranks(values:list, model)->list:
    """`values` (numbers or 0-d tensors) summed over the ranks of a DDP or FSDP2 `model`, as floats: one float64
    all-reduce (one host synchronisation). Otherwise on the CPU (MPS has no float64)."""
    d = is_distributed(model)
    dev = _local(next(model.parameters())).device if d else 'cpu'
    vals = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(dev) for v in values])
    if d: dist.all_reduce(vals)
    return vals.tolist()

def _local(t):
    "The local shard of a DTensor (the tensor itself otherwise)"
    return t.to_local() if hasattr(t, 'to_local') else t

def all_reduce_grads(params:list):
    "Sum the gradients of `params` over the ranks, one flat all-reduce per dtype (a parameter without one counts zero)"
    for p in params:
        if p.grad is None: p.grad = torch.zeros_like(p)
    by_dtype = {}
    for p in params: by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat)
        foreach('copy_')(gs, [f.view_as(g) for f,g in zip(flat.split([g.numel() for g in gs]), gs)])

def sync_batchnorm_world(bn)->int:
    """How many ranks' micro-batches a layer's batch statistics cover: the process group's size for a `SyncBatchNorm`
    in a running process group (ranks of equal micro-batch size), else 1"""
    if isinstance(bn, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(bn.process_group)
    return 1

class AllReduceCounter:
    """State of `count_allreduces`' communication hook: one entry per bucket all-reduce, a round per synchronised
    backward"""
    def __init__(self, process_group=None): self.process_group,self.buckets,self.n_rounds = process_group,[],0
    @property
    def n_calls(self)->int: "Bucket all-reduces so far (a round makes one per bucket)"; return len(self.buckets)
    def reset(self): self.buckets,self.n_rounds = [],0
    def __repr__(self): return f"{type(self).__name__}(n_rounds={self.n_rounds}, n_calls={self.n_calls})"

def _counting_allreduce(state:AllReduceCounter, bucket:dist.GradBucket):
    state.buckets.append(bucket.index())
    if bucket.is_last(): state.n_rounds += 1   # DDP hands over the last bucket once per synchronised backward
    return allreduce_hook(state.process_group, bucket)   # exactly what DDP does without a hook

def count_allreduces(
    model:DistributedDataParallel, # the DDP-wrapped model (`learn.model` once fastai or Accelerate has wrapped it)
    process_group=None, # the group DDP reduces over (default: the world)
)->AllReduceCounter:
    """Register a DDP communication hook that counts gradient all-reduces, then does DDP's default all-reduce.
    Call it before the first backward (DDP accepts one hook per model). Example, inside a launched script:

        learn.model = DistributedDataParallel(learn.model)
        counter = count_allreduces(learn.model)
        learn.fit(1)   # with `learn.accumulate(4)`: counter.n_rounds == learn.gradient_accumulation.steps
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"`count_allreduces` needs a `DistributedDataParallel` model, got {type(model).__name__}")
    state = AllReduceCounter(process_group)
    model.register_comm_hook(state, _counting_allreduce)
    return state

class CollectiveCounter:
    "What `count_collectives` counted: reduce-scatter and all-gather calls (FSDP2), and all-reduces"
    def __init__(self): self.reduce_scatter,self.all_gather,self.all_reduce = 0,0,0
    def __repr__(self): return (f"{type(self).__name__}(reduce_scatter={self.reduce_scatter}, "
                                f"all_gather={self.all_gather}, all_reduce={self.all_reduce})")

# the single-tensor collectives FSDP2 uses (fastai's Recorder gathers losses with `dist.all_gather`: not counted)
_COUNTED = dict(reduce_scatter=('reduce_scatter_single', 'reduce_scatter_tensor'),
                all_gather=('all_gather_single', 'all_gather_into_tensor'), all_reduce=('all_reduce',))

@contextlib.contextmanager
def count_collectives():
    """Count the collectives `torch.distributed` is asked for while open (FSDP2 in torch 2.14 reduces with
    `dist.reduce_scatter_single` and gathers with `dist.all_gather_single`, looked up at each call). It wraps the
    functions, so it changes nothing they do (unlike `CommDebugMode`, whose module hooks break an in-place op on the
    loss)"""
    c,saved = CollectiveCounter(),[]
    for kind,names in _COUNTED.items():
        for n in names:
            f = getattr(dist, n, None)
            if f is None: continue
            def wrap(*a, _f=f, _k=kind, **kw):
                setattr(c, _k, getattr(c, _k)+1); return _f(*a, **kw)
            saved.append((n, f)); setattr(dist, n, wrap)
    try: yield c
    finally:
        for n,f in saved: setattr(dist, n, f)

@contextlib.contextmanager
def gloo_distributed_dl():
    """Let fastai's `DistributedDL` share its sample order over a CPU (gloo) process group, so that
    `learn.distrib_ctx()` / `learn.to_distributed(cpu=True)` runs without a GPU (fastai broadcasts the order through a
    CUDA tensor for NCCL). A context manager; it patches `DistributedDL._broadcast` while open, and only when the
    default group is not NCCL."""
    from fastai.distributed import DistributedDL
    orig = DistributedDL._broadcast
    def _broadcast(self, t, rank):
        if dist.get_backend() == 'nccl': return orig(self, t, rank)
        t = torch.as_tensor(t, dtype=torch.long)
        dist.broadcast(t, rank)
        return t.tolist()
    DistributedDL._broadcast = _broadcast
    try: yield
    finally: DistributedDL._broadcast = orig

def reduce_floats(values:list, op=None)->list:
    "`values` (floats) reduced over the process group (summed, or by `op`), on the device its backend needs"
    t = torch.tensor(values, dtype=torch.float32, device='cuda' if dist.get_backend() == 'nccl' else 'cpu')
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()
