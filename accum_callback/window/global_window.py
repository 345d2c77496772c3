"""One global order of samples for every number of processes (`GradientAccumulation(target_bs=...,
global_window=True)`). fastai's `DistributedDL` gives rank r a contiguous r-th of the epoch's order, so a window of 2
ranks x 2 micro-batches holds other samples than one of 1 rank x 4 (and pads the order by repeating samples).
`WindowShardDL` cuts the same global order (rank 0's, shared) into the micro-batches one process cuts it into, groups
them into windows of `target_bs` samples as one process does, and deals each window's micro-batches whole to the ranks,
in contiguous blocks, the first ranks one more where they do not divide (`deal`). A rank with fewer runs *padding*
micro-batches first (a copy of the window's first one, which `GradientAccumulation` runs in eval mode with zero weight),
so that every rank runs as many micro-batches a window and the window's one reduction finds them all. A window then
holds the same samples cut into the same micro-batches on any number of ranks, for any dataset size, partial last
windows and `drop_last` included, and the run is the same large-batch run on any of them (docs/distributed.md)"""
from __future__ import annotations
import functools, itertools

import torch
import torch.distributed as dist

__all__ = ['share_problem', 'check_fastai_sharding', 'global_samples', 'window_micro_batches', 'deal_share',
           'deal_layout', 'deal',
           'rank_batches', 'window_ends', 'window_shard_dl', 'shard_by_window', 'check_window_share']

def global_samples(dl)->int:
    "Samples in an epoch of the whole training loader (`dl`, or the loader fastai's `DistributedDL` wraps)"
    return dl.__dict__.get('dl', dl).n

def _kept(n:int, bs:int, drop_last:bool)->int:
    "Samples one process's loader reads an epoch (fastai's `drop_last`: whole micro-batches)"
    return n//bs*bs if drop_last else n

def window_micro_batches(n:int, window:int, bs:int, partial:bool=True, drop_last:bool=False)->list:
    """One process's epoch of `n` samples in micro-batches of `bs` (`window` a multiple of `bs`), window by window: how
    many micro-batches each window holds (a partial last one too, unless `partial=False`: no process reads it)"""
    m = _kept(n, bs, drop_last)
    return [window//bs]*(m//window) + ([-(-(m % window)//bs)] if m % window and partial else [])

def deal_share(k:int, world:int, rank:int)->tuple:
    """A window of `k` micro-batches dealt to `world` ranks: rank `rank`'s first micro-batch, how many it runs, how many
    of them are padding"""
    base,extra = divmod(k, world)
    real,per = base + (rank < extra),-(-k//world)
    return rank*base + min(rank, extra),real,per - real

def deal_layout(n:int, window:int, world:int, rank:int, bs:int, partial:bool=True, drop_last:bool=False)->list:
    """Rank `rank`'s windows of an epoch as `(padding, micro-batches)`: it runs `padding` copies, then `micro-batches -
    padding` of the window's own"""
    return [(pad, real + pad) for _,real,pad in (deal_share(k, world, rank)
                                                 for k in window_micro_batches(n, window, bs, partial, drop_last))]

def deal(idxs:list, window:int, world:int, rank:int, bs:int, partial:bool=True, drop_last:bool=False)->list:
    """Rank `rank`'s samples of the global order `idxs`, micro-batch after micro-batch (`deal_layout`): in each window
    its padding (copies of the window's first micro-batch), then its block of the window's micro-batches. Only the
    epoch's last micro-batch can be short, and it ends the list of the rank it falls to (padding comes first)"""
    idxs,out = list(idxs)[:_kept(len(idxs), bs, drop_last)],[]
    for j,k in enumerate(window_micro_batches(len(idxs), window, bs, partial, drop_last)):
        first,real,pad = deal_share(k, world, rank)
        mb = lambda i: idxs[j*window + i*bs:j*window + (i+1)*bs]
        out += mb(0)*pad + [x for i in range(first, first + real) for x in mb(i)]
    return out

def rank_batches(n:int, window:int, world:int, rank:int, bs:int, partial:bool=True, drop_last:bool=False)->int:
    """Micro-batches (loader batches of `bs`) a rank runs in an epoch of `n` samples, padding included: the same on
    every rank"""
    return sum(m for _,m in deal_layout(n, window, world, rank, bs, partial, drop_last))

def window_ends(n:int, window:int, world:int, bs:int, partial:bool=True, drop_last:bool=False)->list:
    "The number of micro-batches every rank has run at each window's end in an epoch (0 first: the epoch's start)"
    return [0, *itertools.accumulate(m for _,m in deal_layout(n, window, world, 0, bs, partial, drop_last))]

@functools.cache
def window_shard_dl()->type:
    """The class `WindowShardDL`, made on first use: fastai's `fastai.distributed` loads Accelerate (and torch's FSDP
    with it), which a fit on one process should not pay for"""
    from fastai.distributed import DistributedDL
    class WindowShardDL(DistributedDL):
        """fastai's `DistributedDL` over `dl`, each window of `window` samples dealt in whole micro-batches (`deal`;
        `partial`: the last one too)"""
        def __init__(self, dl, window:int, rank:int|None=None, world_size:int|None=None, partial:bool=True):
            super().__init__(dl, rank, world_size)
            self.window,self.partial = window,partial

        def _broadcast(self, t, rank:int)->list:
            "The order from `rank` (rank 0) to every rank: a CPU tensor over gloo, a CUDA one over NCCL"
            t = torch.as_tensor(t, dtype=torch.long)
            if dist.get_backend() == 'nccl': t = t.cuda()
            dist.broadcast(t, rank)
            return t.cpu().tolist()

        def layout(self)->list:
            """This rank's windows of an epoch as `(padding, micro-batches)` (`deal_layout`; read at each micro-batch:
            kept)"""
            key = (self.dl.n, self.window, self.world_size, self.rank, self.bs, self.partial, self.drop_last)
            if self.__dict__.get('_layout_key') != key: self._layout,self._layout_key = deal_layout(*key),key
            return self._layout
        def __len__(self)->int:
            return rank_batches(self.dl.n, self.window, self.world_size, self.rank, self.bs, self.partial,
                                self.drop_last)
        def get_idxs(self)->list:
            # (every rank draws it, as fastai's, so RNGs stay alike)
            idxs = self._broadcast(list(self.dl.get_idxs()), 0)
            self.n = len(idxs)
            return deal(idxs, self.window, self.world_size, self.rank, self.bs, self.partial, self.drop_last)
    return WindowShardDL

def shard_by_window(dl, window:int, partial:str):
    """`dl` (fastai's `DistributedDL` of the training loader, as `learn.distrib_ctx()` makes it) re-sharded by windows
    of `window` samples; refused, naming the numbers, where a window does not cut into the ranks' micro-batches"""
    from fastai.distributed import DistributedDL
    if isinstance(dl, window_shard_dl()): return dl
    if not isinstance(dl, DistributedDL): raise ValueError(_NOT_FASTAI.format(type(dl).__name__))
    check_window_share(window, dl.world_size, dl.bs, dl.dl.n, partial, dl.drop_last)
    return window_shard_dl()(dl.dl, window, dl.rank, dl.world_size, partial != 'drop')

_NOT_FASTAI = ("GradientAccumulation(global_window=True) on several processes reads the training loader through "
               "fastai's `DistributedDL` (`learn.distrib_ctx()`, `learn.to_distributed()`, `learn.fsdp_ctx()`), and "
               "this fit's is a {}: launch through fastai's distributed path, or leave global_window out")

def check_fastai_sharding(learn):
    """At fit start: several processes with `global_window` need fastai's sharding of the training loader (its
    `DistributedDL`, or the `DistributedTrainer` that makes one at fit start), which `WindowShardDL` cuts again"""
    import sys
    dd,dl = sys.modules.get('fastai.distributed'),learn.dls.train
    if dd is None or not (isinstance(dl, dd.DistributedDL)
                          or any(isinstance(c, dd.DistributedTrainer) for c in learn.cbs)):
        raise ValueError(_NOT_FASTAI.format(type(dl).__name__))

def share_problem(window:int, world:int, bs:int, n:int, partial:str, drop_last:bool=False)->str|None:
    """Why `world` ranks cannot run each window of `window` samples of an epoch of `n` as one process runs it in
    micro-batches of `bs`, or None. Whole micro-batches are dealt (`deal`), so only a window that is not a whole number
    of micro-batches is refused: one process then closes it at another size"""
    if window % bs:
        return (f"GradientAccumulation(target_bs={window}, global_window=True): a window of {window} samples in "
                f"micro-batches of {bs} is {window/bs:g} micro-batches; give a target_bs that {bs} divides, or a "
                f"loader batch size that divides {window}")
    return None

def check_window_share(window:int, world:int, bs:int, n:int, partial:str, drop_last:bool=False):
    "`share_problem`, raised as a `ValueError`"
    if (p := share_problem(window, world, bs, n, partial, drop_last)) is not None: raise ValueError(p)
