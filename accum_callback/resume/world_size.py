"""Resuming a `global_window` run on another number of processes. Such a run's windows hold the same
samples on any number of processes (`global_window`), and at a window's end a DDP replica holds all a rank needs: the
weights and the optimizer's state are every rank's, the window is empty, and the epoch's place is a count of windows.
So every rank reads rank 0's checkpoint file and counts that place again in its own loader batches. Under FSDP2 the
model and optimizer are in a DCP folder instead (`resume.sharded`), which every rank reads in its own layout. On as
many processes as it was saved on, each rank reads its own file, as any run does (its RNG states: bitwise)"""
from __future__ import annotations

import warnings

from fastai.callback.core import Callback

from .format import CheckpointError, is_rank_shard, read_checkpoint
from ..compat.torch import rng_states
from ..core.distributed import is_fsdp, process_count, process_rank
from .fit_state import callback_states
from ..window.global_window import global_samples, rank_batches, window_ends
from ..core.protocols import RunningStatsPolicy, trained_bn_layers, user_stacklevel

__all__ = ['is_elastic', 'loader_signature', 'save_waits', 'source_rank', 'elastic_state', 'batches_in_world',
           'say_what_differs', 'RankDraws']

def is_elastic(ga)->bool:
    "Can this run resume on another number of processes?"; return ga is not None and ga.window_over_ranks

def loader_signature(learn, ga)->dict:
    """What a checkpoint's signature says of the processes and the training loader: with `global_window` the whole
    data and the window over all ranks (the same on any number of processes), else this rank's batches and the world"""
    dl = learn.dls.train
    if not is_elastic(ga):
        return {'world size': process_count(), 'training loader': f"{len(dl)} batches of {getattr(dl, 'bs', None)}"}
    return {'training loader': f"{global_samples(dl)} samples in micro-batches of {dl.bs}, windows of "
                               f"{ga.window_samples} samples over all ranks"}

def save_waits(ga, model, batches_due:bool)->bool:
    """Does a checkpoint due now wait for the window's end? Under FSDP2, which holds a window's gradients unsharded
    inside its modules until the window's reduce-scatter; in a `global_window` run, whose window's end is where another
    number of processes can take it on (signals, minutes; `every='<n>ba'` saves mid-window as asked)"""
    if ga is None or not ga.window.is_open: return False
    return is_fsdp(model) or (is_elastic(ga) and not batches_due)

def source_rank(ga)->int:
    """Whose checkpoint files this rank looks for: rank 0's in a `global_window` run (it may have run on fewer ranks),
    else its own"""
    return 0 if is_elastic(ga) else process_rank()

def elastic_state(ckpt, serial:int, st:dict, ga, mine:dict|None=None)->tuple[dict,object]:
    """Rank 0's checkpoint `st` (number `serial` of `ckpt`, a `Checkpoint`; `ga` its `GradientAccumulation`) as this
    rank resumes it: saved on as many processes as run now, this rank's own file; on another number, rank 0's, its place
    in the epoch counted in this world's batches (the batch read ahead left out: it is another rank's now). Refused
    mid-window and under FSDP2. `mine`: this rank's own file, read already. Returns the state and the file it came
    from"""
    learn = ckpt.learn
    old,new = st.get('world', 1),process_count()
    own = ckpt.file(serial, process_rank())
    # the model's layout: a DCP folder (FSDP2) reads into any; whole tensors (DDP, one process) into all but FSDP2; each
    # rank's FSDP2 shards in its own file (written before the DCP folder) on as many processes under FSDP2 only
    legacy,fsdp = bool(st['signature'].pop('FSDP2', False)) and not st.get('sharded'),is_fsdp(learn.model)
    if not st.get('sharded') and (fsdp != legacy or (legacy and old != new)):
        held = "each rank's FSDP2 shards" if legacy else "whole tensors (saved under DDP or on one process)"
        raise CheckpointError(f"Checkpoint: {ckpt.file(serial, 0)} holds {held}, and this run has {new} process(es)"
                              f"{' under FSDP2' if fsdp else ''}: resume it on {old} process(es) under "
                              f"{'FSDP2' if legacy else 'DDP'}, or start afresh with Checkpoint(..., resume=False)")
    if old == new:
        mine = st if process_rank() == 0 else mine if mine is not None else read_checkpoint(own)
        mine['signature'].pop('FSDP2', None)
        return mine,own
    ga_key = next(k for k,cb,_,_ in callback_states(learn, ckpt) if cb is ga)
    where = f"Checkpoint: {ckpt.file(serial, 0)} was saved on {old} process(es) and this run has {new}"
    shard = _rank_shard(st)
    if shard:
        raise CheckpointError(f"{where}, and {shard} holds a rank's shard, which another number cannot read: launch "
                              f"{old} processes")
    say_what_differs(learn, old, new)
    if st['where'] != 'mid': return st,ckpt.file(serial, 0)
    if st['callbacks'][ga_key]['window']['n_micro']:
        raise CheckpointError(f"{where}, and it holds half a window ({st['callbacks'][ga_key]['window']['n_micro']} "
                              f"micro-batch(es) a rank), which cannot be cut again for {new}: launch {old} processes, "
                              "or resume from a checkpoint at a window's end (`every=`, epoch ends and signals save "
                              "there)")
    window,bs,n = ga.window_samples,learn.dls.train.bs,global_samples(learn.dls.train)
    deal = dict(bs=bs, partial=ga.window_partial != 'drop',
                drop_last=bool(getattr(learn.dls.train, 'drop_last', False)))
    k = batches_in_world(st['k'], n, window, old, new, **deal)
    per_epoch = rank_batches(n, window, new, process_rank(), **deal)
    return dict(st, k=k, iter_done=k, ahead=None, ahead_device=None,
                train_iter=st['epoch']*per_epoch + k),ckpt.file(serial, 0)

def batches_in_world(k:int, n:int, window:int, old:int, new:int, bs:int, partial:bool=True, drop_last:bool=False)->int:
    """A rank's micro-batches done in an epoch of `n` samples, `k` on `old` processes at a window's end, counted again
    on `new` processes: the same windows done (`global_window.deal`: each window's micro-batches dealt whole, padding
    included, as many on every rank)"""
    ends = window_ends(n, window, old, bs, partial, drop_last)
    if k not in ends:
        raise CheckpointError(f"Checkpoint: {k} micro-batches a rank is not a window's end on {old} processes")
    return window_ends(n, window, new, bs, partial, drop_last)[ends.index(k)]

def _rank_shard(o, where='state')->str|None:
    "Where in `o` (a checkpoint's state) a rank's shard of a DTensor is (a callback's state), or None"
    if is_rank_shard(o): return where
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, (list, tuple)) else ()
    return next((w for k,v in items if (w := _rank_shard(v, f'{where}[{k!r}]'))), None)

# -- what another number of processes cannot keep the same (said at resume, with the measured difference) -------------
_MEASURED = "docs/resume.md#what-another-number-of-processes-changes"

def say_what_differs(learn, old:int, new:int):
    """Said when a run saved on `old` processes resumes on `new`: BatchNorm layers whose running statistics training
    updates (each rank keeps its own: DDP carries rank 0's), now; and, at the first training micro-batch that draws from
    the global RNGs (dropout, random transforms: each rank draws its own), one line more (`RankDraws`)"""
    policy = next((cb for cb in learn.cbs if isinstance(cb, RunningStatsPolicy)), None)
    same = policy is not None and (policy.keeps_running_stats() or policy.pools_over_ranks())
    bns = [] if same else trained_bn_layers(learn.model, learn)
    if bns and process_rank() == 0:
        mode = getattr(policy, 'mode', None)
        weights = 'nor the weights: Batch Renorm corrects with them' if mode == 'renorm' else 'the weights are'
        warnings.warn(f"Checkpoint: resumed on {new} process(es) from {old}: {len(bns)} BatchNorm layer(s) update "
                      f"their running statistics on each rank's micro-batches (mode {mode!r}), so those statistics are "
                      f"not the uninterrupted run's ({weights}; "
                      f"'pool', 'freeze' and 'groupnorm' keep both: {_MEASURED})", stacklevel=user_stacklevel())
    learn.add_cb(RankDraws(old, new))

class RankDraws(Callback):
    """Watches the training micro-batches of a run resumed on another number of processes: one that draws from the
    global RNGs between the previous micro-batch's end and its own backward (its loading, its forward and backward: not
    the epoch's start) draws on each rank, so the run is not the uninterrupted one: said once, then this leaves"""
    order,run_valid = 96,False
    def __init__(self, old:int, new:int): self.old,self.new,self.last = old,new,None
    # (joined at the resumed fit's start, after its `before_fit`: one left by an interrupted fit leaves)
    def before_fit(self): self.learn.remove_cb(self)
    def before_train(self): self.last = None
    def after_backward(self):
        if self.last is None or _same(self.last, rng_states()): return
        if process_rank() == 0:
            warnings.warn(f"Checkpoint: resumed on {self.new} process(es) from {self.old}: training draws random "
                          "numbers (dropout, random transforms), which each rank draws for its own micro-batches, so "
                          f"this is not the uninterrupted run (the samples of each window are): {_MEASURED}",
                          stacklevel=user_stacklevel())
        self.learn.remove_cb(self)
    def after_batch(self): self.last = rng_states()
    def after_fit(self):
        if self in self.learn.cbs: self.learn.remove_cb(self)

def _same(a, b)->bool:
    import torch
    eq = lambda x, y: (torch.equal(x, y) if isinstance(x, torch.Tensor)
                       else all(map(eq, x, y)) if isinstance(x, (list, tuple))
                       else bool((x == y).all()) if hasattr(x, 'all') else x == y)
    return all(map(eq, a, b))
