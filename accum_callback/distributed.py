"Check how often DDP all-reduces gradients (one round per optimizer step under `GradientAccumulation`), and run fastai's DDP path on CPU"
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

__all__ = ['AllReduceCounter', 'count_allreduces', 'gloo_distributed_dl']

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
