"""One global order of samples for every number of processes (`GradientAccumulation(target_bs=..., global_window=True)`).
fastai's `DistributedDL` gives rank r a contiguous r-th of the epoch's order, so a window of 2 ranks x 2 micro-batches
holds other samples than one of 1 rank x 4 (and pads the order by repeating samples). `WindowShardDL` cuts the same
global order (rank 0's, shared) into windows of `target_bs` samples and gives each rank its contiguous share of each
window: a window holds the same samples, cut into the same micro-batches, on 1, 2 or 4 ranks, and the run is the same
large-batch run on any of them (docs/distributed.md)"""
from __future__ import annotations
import functools

import torch
import torch.distributed as dist

__all__ = ['share_problem', 'check_fastai_sharding', 'global_samples', 'window_share', 'rank_batches', 'window_shard_dl', 'shard_by_window', 'check_window_share']

def global_samples(dl)->int:
    "Samples in an epoch of the whole training loader (`dl`, or the loader fastai's `DistributedDL` wraps)"
    return dl.__dict__.get('dl', dl).n

def window_share(idxs:list, window:int, world:int, rank:int, partial:bool=True, unit:int=1)->list:
    """Rank `rank`'s samples of the global order `idxs`: its contiguous `window/world` share of each whole window of
    `window` samples, and of a partial last window as even a share as can be, in `unit`s, the first ranks one more
    (`partial=False`: left out, no rank reads it). `unit`: the micro-batch where the loader drops an incomplete one
    (fastai's `drop_last`): the order is cut to whole micro-batches first, as one process's loader cuts it"""
    idxs = idxs[:len(idxs)//unit*unit]
    share,full = window//world,len(idxs)//window*window
    out = [i for s in range(0, full, window) for i in idxs[s+rank*share:s+(rank+1)*share]]
    if partial and len(idxs) > full:
        base,extra = divmod((len(idxs)-full)//unit, world)
        lo = full + (rank*base + min(rank, extra))*unit
        out += idxs[lo:lo+(base+(rank < extra))*unit]
    return out

def rank_batches(n:int, window:int, world:int, rank:int, bs:int, partial:bool=True, drop_last:bool=False)->int:
    "Loader batches of `bs` that rank `rank` of `world` reads in an epoch of `n` samples (`window_share`)"
    return -(-len(window_share(range(n), window, world, rank, partial, bs if drop_last else 1))//bs)

@functools.cache
def window_shard_dl()->type:
    """The class `WindowShardDL`, made on first use: fastai's `fastai.distributed` loads Accelerate (and torch's FSDP
    with it), which a fit on one process should not pay for"""
    from fastai.distributed import DistributedDL
    class WindowShardDL(DistributedDL):
        "fastai's `DistributedDL` over `dl`, sharded window by window of `window` samples (`window_share`; `partial`: the last one shared too)"
        def __init__(self, dl, window:int, rank:int|None=None, world_size:int|None=None, partial:bool=True):
            super().__init__(dl, rank, world_size)
            self.window,self.partial = window,partial

        def _broadcast(self, t, rank:int)->list:
            "The order from `rank` (rank 0) to every rank: a CPU tensor over gloo, a CUDA one over NCCL"
            t = torch.as_tensor(t, dtype=torch.long)
            if dist.get_backend() == 'nccl': t = t.cuda()
            dist.broadcast(t, rank)
            return t.cpu().tolist()

        def __len__(self)->int: return rank_batches(self.dl.n, self.window, self.world_size, self.rank, self.bs, self.partial, self.drop_last)
        def get_idxs(self)->list:
            idxs = self._broadcast(list(self.dl.get_idxs()), 0)   # (every rank draws it, as fastai's, so RNGs stay alike)
            self.n = len(idxs)
            return window_share(idxs, self.window, self.world_size, self.rank, self.partial, self.bs if self.drop_last else 1)
    return WindowShardDL

def shard_by_window(dl, window:int, partial:str):
    """`dl` (fastai's `DistributedDL` of the training loader, as `learn.distrib_ctx()` makes it) re-sharded by windows
    of `window` samples; refused, naming the numbers, where a window does not cut into the ranks' micro-batches"""
    from fastai.distributed import DistributedDL
    if isinstance(dl, window_shard_dl()): return dl
    if not isinstance(dl, DistributedDL): raise ValueError(_NOT_FASTAI.format(type(dl).__name__))
    check_window_share(window, dl.world_size, dl.bs, dl.dl.n, partial, dl.drop_last)
    return window_shard_dl()(dl.dl, window, dl.rank, dl.world_size, partial != 'drop')

_NOT_FASTAI = ("GradientAccumulation(global_window=True) on several processes reads the training loader through fastai's "
               "`DistributedDL` (`learn.distrib_ctx()`, `learn.to_distributed()`, `learn.fsdp_ctx()`), and this fit's is a "
               "{}: launch through fastai's distributed path, or leave global_window out")

def check_fastai_sharding(learn):
    """At fit start: several processes with `global_window` need fastai's sharding of the training loader (its
    `DistributedDL`, or the `DistributedTrainer` that makes one at fit start), which `WindowShardDL` cuts again"""
    import sys
    dd,dl = sys.modules.get('fastai.distributed'),learn.dls.train
    if dd is None or not (isinstance(dl, dd.DistributedDL) or any(isinstance(c, dd.DistributedTrainer) for c in learn.cbs)):
        raise ValueError(_NOT_FASTAI.format(type(dl).__name__))

def share_problem(window:int, world:int, bs:int, n:int, partial:str, drop_last:bool=False)->str|None:
    """Why `world` ranks cannot share each window of `window` samples of an epoch of `n` in micro-batches of `bs` as
    one process runs them (`drop_last`: fastai's loader drops an incomplete last micro-batch), or None"""
    if window % (world*bs):
        return (f"GradientAccumulation(target_bs={window}, global_window=True): a window of {window} samples over "
                f"{world} ranks in micro-batches of {bs} is {window/(world*bs):g} micro-batches a rank; give a "
                f"target_bs that {world}x{bs} = {world*bs} divides, or a loader batch size that divides {window//world}")
    m = n % window//bs*bs if drop_last else n % window   # a partial last window (dropped: no rank reads it)
    base,extra = divmod(m//bs if drop_last else m, world)
    if m and partial != 'drop' and ((extra if drop_last else base == 0 or (extra and base % bs == 0))):
        return (f"GradientAccumulation(target_bs={window}, global_window=True): {n} samples leave a last window of {m}"
                + (f" (the loader's drop_last leaves {n % window - m} out)" if drop_last and n % window - m else '')
                + f", which {world} ranks cannot share in as many micro-batches of {bs} each: give partial='drop' (every "
                "number of processes drops it), or a target_bs that leaves another remainder")
    return None

def check_window_share(window:int, world:int, bs:int, n:int, partial:str, drop_last:bool=False):
    "`share_problem`, raised as a `ValueError`"
    if (p := share_problem(window, world, bs, n, partial, drop_last)) is not None: raise ValueError(p)
