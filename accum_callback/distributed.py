"""Accumulation under DDP: the no_sync rule (only the micro-batch that steps all-reduces), window totals summed over
ranks, SyncBatchNorm's global counts; `count_allreduces` to check the rule, and fastai's DDP path on CPU (gloo)"""
import contextlib

import torch, torch.nn as nn
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

__all__ = ['is_ddp', 'is_fsdp', 'unwrap', 'world_size', 'enter_no_sync', 'sum_over_ranks', 'all_reduce_grads',
           'sync_batchnorm_world', 'AllReduceCounter', 'count_allreduces', 'gloo_distributed_dl']

def is_ddp(model)->bool: return isinstance(model, DistributedDataParallel)

def is_fsdp(model)->bool:
    "Is `model` (or the module DDP wraps) sharded with FSDP2's `fully_shard`, by whoever sharded it?"
    try: from torch.distributed.fsdp import FSDPModule
    except ImportError: return False
    return isinstance(unwrap(model), FSDPModule)

def unwrap(model):
    "The module inside DDP / DataParallel (the model itself otherwise)"
    return model.module if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model

def world_size(model)->int: "Ranks a DDP `model` averages its gradients over (1 when not DDP)"; return dist.get_world_size() if is_ddp(model) else 1

def enter_no_sync(model):
    """Enter `model.no_sync()` (a micro-batch that does not step accumulates locally, without an all-reduce) and return
    the open context for `exit_no_sync`; None when `model` is not DDP"""
    if not is_ddp(model): return None
    ctx = model.no_sync(); ctx.__enter__()
    return ctx

def exit_no_sync(ctx):
    if ctx is not None: ctx.__exit__(None, None, None)

def sum_over_ranks(values:list, model)->list:
    """`values` (numbers or 0-d tensors) summed over the ranks of a DDP `model`, as floats: one float64 all-reduce (one
    host synchronisation). Without DDP, on the CPU (MPS has no float64)."""
    dev = next(model.parameters()).device if is_ddp(model) else 'cpu'
    vals = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(dev) for v in values])
    if is_ddp(model): dist.all_reduce(vals)
    return vals.tolist()

def all_reduce_grads(params:list):
    "Sum the gradients of `params` over the ranks, one flat all-reduce per dtype (a parameter without one counts zero)"
    for p in params:
        if p.grad is None: p.grad = torch.zeros_like(p)
    by_dtype = {}
    for p in params: by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for gs in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(gs)
        dist.all_reduce(flat)
        torch._foreach_copy_(gs, list(torch._utils._unflatten_dense_tensors(flat, gs)))

def sync_batchnorm_world(bn)->int:
    """How many ranks' micro-batches a layer's batch statistics cover: the process group's size for a `SyncBatchNorm`
    in a running process group (ranks of equal micro-batch size), else 1"""
    if isinstance(bn, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized(): return dist.get_world_size(bn.process_group)
    return 1

class AllReduceCounter:
    "State of `count_allreduces`' communication hook: one entry per bucket all-reduce, a round per synchronised backward"
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

@contextlib.contextmanager
def gloo_distributed_dl():
    """Let fastai's `DistributedDL` share its sample order over a CPU (gloo) process group, so that `learn.distrib_ctx()`
    / `learn.to_distributed(cpu=True)` runs without a GPU (fastai broadcasts the order through a CUDA tensor for NCCL).
    A context manager; it patches `DistributedDL._broadcast` while open, and only when the default group is not NCCL."""
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
