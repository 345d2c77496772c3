"""BatchNorm statistics of the current weights ("precise BN": Wu & Johnson 2021, "Rethinking 'Batch' in BatchNorm";
fvcore's `update_bn_stats`). A BatchNorm layer's running statistics move once per optimizer step, so after few steps
(a short run, or one from scratch) they lag far behind what the final weights produce, accumulated or not. Here every
BatchNorm layer's running mean and variance are recomputed from many training items with the current weights: each
layer normalises every micro-batch with its own statistics, as in training, and its inputs' statistics are pooled
exactly over the micro-batches (and over DDP/FSDP2 ranks, as SyncBatchNorm would), without gradients, and without
touching the weights, the optimizer or any RNG."""
from __future__ import annotations
import contextlib

import torch, torch.nn as nn
import torch.distributed as dist
from fastai.torch_core import find_bs, to_device

from ..compat.torch import rng_states, rngs_kept, set_rng_states, run_eagerly   # (rngs_kept, rng_states re-exported)
from ..core.distributed import is_distributed, process_count, process_rank
from ..window.global_window import deal_share
from ..core.protocols import bn_layers_with_stats, trained_bn_layers   # (re-exported: their home before 0.3)
from ..core.batches import prepare_batch
from ..core.loaders import batch_sizes, model_device
from ..micro.loader import loader_pieces
from ..micro.pieces import piece_bounds, slice_batch
from .norm_layers import set_norm_mode

__all__ = ['pooled_moments', 'Unrecorded', 'rngs_kept', 'rng_states', 'set_rng_states', 'recorder_kept',
           'PopulationStats', 'precise_bn_stats', 'update_bn_stats', 'bn_layers_with_stats', 'trained_bn_layers',
           'training_items']

def pooled_moments(n:torch.Tensor, mean:torch.Tensor, m2:torch.Tensor, tot=None)->tuple:
    """The package's one pooled estimator (Chan et al.): `(items, mean, m2)` of the union of G groups given per group as
    `(G, C)` tensors of items `n`, means and sums of squared deviations from their own mean `m2`: the mean of all items,
    and `m2` as each group's own plus its mean's spread about the whole mean (no sum of squares, which cancels for
    inputs far from zero). `tot`: the items, where the caller knows them on the host (no device synchronisation).
    Used by 'pool' (`pool.pooled_mean_var`), the recomputed statistics and `check_batchnorm` (`PopulationStats`)

    >>> x = torch.arange(10.).double(); a,b = x[:4],x[4:]
    >>> tot,mu,m2 = pooled_moments(torch.tensor([[4.],[6.]]).double(), torch.stack([a.mean(), b.mean()])[:,None],
    ...                            torch.stack([a.var(correction=0)*4, b.var(correction=0)*6])[:,None])
    >>> (float(tot), mu.item(), round(m2.item()/9, 10)) == (10.0, x.mean().item(), round(x.var().item(), 10))
    True
    """
    tot = n.sum(0) if tot is None else tot
    mu = (n*mean).sum(0)/tot
    return tot,mu,m2.sum(0) + (n*(mean - mu).square()).sum(0)

class PopulationStats:
    """One layer's inputs over many micro-batches, per channel, in float64: items `n`, `mean` and `m2` (the sum of
    squared deviations from the mean), pooled from each micro-batch's mean and population variance by Chan et al.'s
    update (no sum of squares, which cancels catastrophically for inputs far from zero: offset 1e4, sd 0.01); `var` is
    unbiased (BatchNorm's running convention)"""
    def __init__(self): self.n,self.mu,self.m2 = 0.,None,None
    @property
    def s1(self):
        "The per-channel sum (None before the first micro-batch)"; return None if self.mu is None else self.mu*self.n
    def update(self, mean:torch.Tensor, var:torch.Tensor, n:int):
        mean,m2 = mean.double(),var.double()*n
        if self.mu is None: self.n,self.mu,self.m2 = float(n),mean,m2; return
        tot = self.n + n
        _,self.mu,self.m2 = pooled_moments(mean.new_tensor([[self.n], [float(n)]]), torch.stack([self.mu, mean]),
                                           torch.stack([self.m2, m2]), tot)
        self.n = tot
    def sum_over_ranks(self):
        "Every rank's items together (two all-reduces: the counts and sums, then the deviations about the global mean)"
        c = len(self.mu)
        t = torch.cat([self.mu*self.n, self.mu.new_tensor([self.n])])
        dist.all_reduce(t)
        n,mu = float(t[-1]),t[:c]/float(t[-1])
        m2 = self.m2 + self.n*(self.mu - mu).square()
        dist.all_reduce(m2)
        self.n,self.mu,self.m2 = n,mu,m2
    @property
    def mean(self)->torch.Tensor: return self.mu
    @property
    def var(self)->torch.Tensor:
        "The unbiased variance (what BatchNorm keeps as `running_var`)"
        return self.m2/max(self.n-1, 1)

_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)   # exactly these: their running update is torch's own

def _pooled(seen:list)->PopulationStats:
    """The micro-batches' (mean, population variance, n) pooled exactly in float64: the mean of all items, and the sum
    of squared deviations as each micro-batch's own plus its mean's about the whole mean (two passes over the
    per-channel figures, none over the activations)"""
    s = PopulationStats()
    if not seen: return s
    mean = torch.stack([m for m,_,_ in seen]).double()
    var = torch.stack([v for _,v,_ in seen]).double()
    n = mean.new_tensor([float(k) for _,_,k in seen])[:,None]
    tot = float(sum(k for _,_,k in seen))   # (on the host: no synchronisation with the device)
    s.n,s.mu,s.m2 = pooled_moments(n, mean, var*n, tot)
    return s

class Unrecorded(tuple):
    """Inputs `precise_bn_stats` runs but does not count: a rank's padding (`training_items` deals whole micro-batches
    to the ranks, and a rank with fewer runs copies, so that every rank runs as many forwards: DDP's buffer broadcast
    and FSDP2's all-gathers are collectives)"""

class _Stats(dict):
    "`{layer: PopulationStats}`, and `n_items`: the items (samples) the batches held"
    n_items = 0

@torch.no_grad()
def precise_bn_stats(model:nn.Module, batches, forward=None, ctx=contextlib.nullcontext, layers:list|None=None)->dict:
    """`{layer: PopulationStats}` of the inputs of the BatchNorm `layers` (default `trained_bn_layers(model)`: those
    training updates, not the ones frozen in eval mode) over `batches` (each an input or a tuple of inputs to `forward`,
    default `model(*xb)`), run with those layers in training mode (each micro-batch normalised by its own statistics)
    and everything else in eval mode (no dropout; frozen BatchNorm layers normalise with their running statistics, as
    in training). The statistics are float64 sums of each micro-batch's statistics, computed in the input's precision
    (float32 at least). Nothing of the model changes: modes, buffers and Batch Renorm's step counters are put back, and
    every RNG. `ctx()` wraps each forward (autocast, say). Under DDP or FSDP2 (a sharded model or a running process
    group with a distributed `model`) the statistics are every rank's: every rank must pass the same number of
    batches."""
    forward = forward or (lambda xb: model(*xb))
    bns = trained_bn_layers(model) if layers is None else list(layers)
    n_items = 0
    seen = {bn: [] for bn in bns}   # each micro-batch's (mean, population variance, items a channel)
    recording = [True]   # (off for an `Unrecorded` batch: a rank's padding)
    modes = [(m, m.training) for m in model.modules()]
    bufs = [(t, t.detach().clone()) for bn in bns for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
            if t is not None]
    steps = [(m, m.renorm_steps) for m in bns if hasattr(m, 'renorm_steps')]
    moms = [(bn, bn.momentum) for bn in bns]
    def own(bn):
        """A plain BatchNorm layer computes its input's statistics itself: with momentum 1 its running buffers are the
        micro-batch's mean and unbiased variance after its forward, read back (no second pass over the activations)"""
        def post(mod, inp, out):
            if not recording[0]: return
            n = inp[0].numel()//inp[0].shape[1]
            seen[mod].append((mod.running_mean.clone(), mod.running_var*((n-1)/n), n))
        bn.momentum = 1.
        bn.running_mean.zero_(); bn.running_var.fill_(1.)   # (0 x a nan or inf left there would be nan)
        return bn.register_forward_hook(post)
    def hook(bn):
        "Any other (Batch Renorm, SyncBatchNorm, subclasses): the input's statistics computed here"
        def pre(mod, inp):
            if not recording[0]: return
            x = inp[0]
            dims = [0] + list(range(2, x.ndim))
            var,mean = torch.var_mean(x if x.dtype == torch.float64 else x.float(), dim=dims, correction=0)
            seen[mod].append((mean, var, x.numel()//x.shape[1]))
        return bn.register_forward_pre_hook(pre)
    handles = []
    try:
        for bn in bns:
            plain = type(bn) in _PLAIN_BN and bn.running_var.dtype in (torch.float32, torch.float64)
            handles.append(own(bn) if plain else hook(bn))
        with rngs_kept(), run_eagerly(model):
            model.eval()
            for bn in bns: set_norm_mode(bn, True)   # (their own mode: a norm-act layer's drop stays in eval)
            for xb in batches:
                recording[0] = not isinstance(xb, Unrecorded)
                xb = xb if isinstance(xb, (tuple, list)) else (xb,)
                with ctx(): forward(tuple(xb))
                if recording[0]: n_items += xb[0].shape[0]
    finally:
        for h in handles: h.remove()
        for m,t in modes: m.training = t
        for bn,mom in moms: bn.momentum = mom
        for t,v in bufs: t.copy_(v)
        for m,k in steps: m.renorm_steps = k
    stats = _Stats({bn: _pooled(seen[bn]) for bn in bns})
    if is_distributed(model) and dist.is_available() and dist.is_initialized():
        for bn,s in stats.items():   # (every rank joins, one that ran no item of a layer with zeros)
            if s.s1 is None:
                s.n,s.mu,s.m2 = 0.,*[bn.running_mean.new_zeros(bn.running_mean.shape, dtype=torch.float64)]*2
            s.sum_over_ranks()
            if s.n == 0: s.mu = s.m2 = None
        t = torch.tensor([float(n_items)], dtype=torch.float64,
                         device=next(iter(stats)).running_mean.device if stats else 'cpu')
        dist.all_reduce(t); n_items = int(t.item())
    stats.n_items = n_items
    return stats

@torch.no_grad()
def update_bn_stats(model:nn.Module, batches, forward=None, ctx=contextlib.nullcontext, layers:list|None=None)->int:
    """Recompute the `running_mean` and `running_var` of the BatchNorm `layers` (default: those training updates, see
    `trained_bn_layers`) from `batches` (`precise_bn_stats`) and write them in; `num_batches_tracked`, frozen layers and
    everything else are left alone. Returns the items (samples) of the batches, all ranks together"""
    stats = precise_bn_stats(model, batches, forward, ctx, layers)
    for bn,s in stats.items():
        if s.s1 is None: continue   # a layer no batch reached
        bn.running_mean.copy_(s.mean.to(bn.running_mean.dtype)); bn.running_var.copy_(s.var.to(bn.running_var.dtype))
    return stats.n_items

def training_items(learn, n:int, size:int|None=None, seed:int=0, world:int|None=None):
    """Yield about `n` items of `learn`'s training loader as inputs (tuples), on the model's device: its batches in an
    order of their own (shuffled from `seed`; the training loader and its RNG are not touched), cut into pieces of at
    most `size` items where given (the Learner's micro-batches), up to the first piece that reaches `n`. The same items
    in the same pieces on any number of processes: under DDP or FSDP2 (`world`: default the ranks of a distributed
    model, else 1) one process's pieces are dealt whole to the ranks in contiguous blocks, each rank loading only the
    loader batches that hold its own, and a rank with fewer pieces yields copies of one as `Unrecorded` (padding), so
    that every rank runs as many forwards. A loader that cannot be indexed (no `new`, `get_idxs` or `bs`) is read by
    each rank from its own shard instead, `n / ranks` items each (rounded up)"""
    world = (process_count() if is_distributed(learn.model) else 1) if world is None else world
    dl = _one_process_loader(learn, seed)
    if dl is None:   # (each rank its own shard)
        yield from _first_items(loader_pieces(learn, size, shuffle=True, seed=seed, drop_last=False), learn,
                                -(-n // world))
        return
    pieces,seen,bs = [],0,dl.bs   # one process's pieces up to the first that reaches n: (loader batch, start, end)
    for bi,m in enumerate(batch_sizes(dl)):
        if seen >= n: break
        for s,e in piece_bounds(m, size):
            if seen >= n: break
            pieces.append((bi, s, e)); seen += e - s
    first,real,pad = deal_share(len(pieces), world, process_rank() if world > 1 else 0)
    mine = pieces[first:first + real] or pieces[:1]   # (a rank dealt nothing pads with the first piece)
    b0,b1 = mine[0][0],mine[-1][0]
    orig = dl.get_idxs
    dl.get_idxs = lambda: list(orig())[b0*bs:(b1 + 1)*bs]   # (the order drawn whole, as one process draws it)
    want,pad_x = set(mine[:real] if real else []),None
    for bi,b in enumerate(dl, start=b0):
        b,nb = to_device(b, model_device(learn.model)),find_bs(b)
        for s,e in piece_bounds(nb, size):
            if (bi, s, e) not in want and not (pad_x is None and real == 0): continue
            x = prepare_batch(learn, b if (s, e) == (0, nb) else slice_batch(b, s, e))[0]   # (as training sees it)
            if pad_x is None: pad_x = x
            if (bi, s, e) in want: yield x
        if bi >= b1: break
    for _ in range(pad): yield Unrecorded(pad_x)

def _inputs(learn, b)->tuple:
    "A batch's inputs (the loaders' `n_inp` first parts) as a tuple"
    n_inp = getattr(learn.dls, 'n_inp', 1)
    if not isinstance(b, (tuple, list)): return (b,)
    return tuple(b[:n_inp]) if len(b) > 1 else (b[0],)

def _first_items(pieces, learn, n:int):
    "The inputs of `loader_pieces`'s pieces up to the first that reaches `n` items"
    seen = 0
    for b,(s,e,_) in pieces:
        yield _inputs(learn, b)
        seen += e - s
        if seen >= n: return

def _one_process_loader(learn, seed:int):
    """A copy of the training loader one process reads (the loader fastai's `DistributedDL` wraps), shuffled from
    `seed` without dropping a short last batch, as `own_loader` copies it on one process; None where it cannot be
    indexed"""
    import random, sys
    dl = learn.dls.train
    dd = sys.modules.get('fastai.distributed')
    if dd is not None and isinstance(dl, dd.DistributedDL): dl = dl.dl
    if not (hasattr(dl, 'new') and hasattr(dl, 'get_idxs') and getattr(dl, 'bs', None) and getattr(dl, 'n', None)):
        return None
    try: dl = dl.new(shuffle=True, drop_last=False)
    except Exception: return None
    if hasattr(dl, 'rng'): dl.rng = random.Random(seed)
    return dl

@contextlib.contextmanager
def recorder_kept(learn):
    "The Recorder's history (losses, values, lrs, iters) as it was after the block: fastai's `validate()` empties it"
    rec = getattr(learn, 'recorder', None)
    keys = [k for k in ('lrs', 'iters', 'losses', 'values', 'log') if rec is not None and hasattr(rec, k)]
    saved = {k: getattr(rec, k) for k in keys}
    try: yield
    finally:
        for k,v in saved.items(): setattr(rec, k, v)
