"""BatchNorm's running statistics under accumulation, the estimator and its hooks: the momentum rule
(`accumulated_momentum`), the pooled statistics of a window's micro-batches ('pool': `PooledStats`, through the
package's one pooled estimator, `pooled_mean_var` over `precise.pooled_moments`), and `RecomputeGuard`, which keeps
activation checkpointing from counting a micro-batch twice. `batchnorm/callback.py`'s modes and callback use them."""
from __future__ import annotations
from numbers import Real

import torch

from ..compat.torch import foreach, module_dicts
from ..core.distributed import sync_batchnorm_world
from .precise import pooled_moments
from ..core.args import whole_number

__all__ = ['accumulated_momentum', 'pooled_mean_var', 'PooledStats', 'RecomputeGuard']

def accumulated_momentum(
    m:float|None, # a BatchNorm momentum (None: cumulative average, left as is)
    k:int, # micro-batches per optimizer step
)->float|None:
    """The per-micro-batch momentum whose `k` updates weigh the old running statistics as one update with `m` does:
    `1-(1-m)**(1/k)`, so `(1-accumulated_momentum(m, k))**k == 1-m`.

    >>> round(accumulated_momentum(0.1, 4), 6)
    0.025996
    """
    k = whole_number(k, 'k')
    if m is None: return None
    if isinstance(m, bool) or not isinstance(m, Real) or not 0 <= m <= 1:
        raise ValueError(f"`m` must be in [0, 1] or None, got {m!r}")
    return 1 - (1-float(m))**(1/k)

def pooled_mean_var(
    n:torch.Tensor, # (G, C) items behind each group's statistics (0 for an empty group, whose mean and var must be 0)
    mean:torch.Tensor, # (G, C) each group's mean
    var:torch.Tensor, # (G, C) each group's unbiased variance
)->tuple[torch.Tensor,torch.Tensor]:
    """Mean and unbiased variance of the union of the groups (Chan et al.): within-group sums of squares plus the
    spread of the group means. Exactly the statistics one batch of all the items gives, up to rounding.

    >>> x = torch.arange(10.).double(); a,b = x[:4],x[4:]
    >>> m,v = pooled_mean_var(torch.tensor([[4.],[6.]]).double(), torch.stack([a.mean(), b.mean()])[:,None],
    ...                       torch.stack([a.var(), b.var()])[:,None])
    >>> (m.item(), round(v.item(), 10)) == (x.mean().item(), round(x.var().item(), 10))
    True
    """
    tot,m,m2 = pooled_moments(n, mean, (n-1).clamp_min(0)*var)   # (the package's one pooled estimator)
    return m,m2/(tot-1)

class PooledStats:
    """Per-micro-batch statistics of a set of BatchNorm layers on one device and dtype, pooled once per window.

    BatchNorm's own kernel computes each micro-batch's mean and unbiased variance: with momentum 1 it writes them into
    the running buffers. So before each training forward of a layer its running buffers are swapped for views into one
    preallocated window tensor `(slots, 2, channels of all layers)`, and put back after (BatchNorm's kernel writes
    buffers without bumping autograd's version counter, and nothing else writes the window tensor until the window's
    backward passes are over). Per micro-batch nothing else runs: no allocation, no extra kernel, no host
    synchronisation. When a window steps, `close` pools every layer's slots and updates every layer's running
    statistics in a fixed handful of batched and `_foreach` ops, whatever the number of layers; the item counts travel
    in one host-to-device copy (from pinned memory on a GPU).

    `staged` (a compiled model): no buffer is swapped (torch 2.4's dynamo traced the swap wrongly: statistics off by
    several times their size); the layers keep momentum 0 (their running buffers unchanged), and the pre-hook writes the
    micro-batch's mean and unbiased variance, one `var_mean` of the input, into a staging slot that depends only on how
    often the layer already ran in this micro-batch, never on the micro-batch's place in the window; the slots are
    copied into the window tensor after the backward (one copy a micro-batch). What torch.compile traces of the hooks is
    the same at every micro-batch, so it compiles no graph more than without them. `num_batches_tracked`, which the
    layers then count per forward, is set back to one count a window.

    `over_ranks` (a `global_window` run, whose window is the same samples on any number of processes): the window is
    pooled over every rank's micro-batches, one all-gather of each rank's pooled statistics a window."""
    def __init__(self, bns:list, momenta:list, cap:int=1, staged:bool=False, over_ranks:bool=False):
        self.bns,self.momenta,self.over_ranks = bns,momenta,over_ranks
        rm = bns[0].running_mean
        self.device,self.dtype,self.sizes = rm.device,rm.dtype,[bn.num_features for bn in bns]
        L,dev = len(bns),rm.device
        self.offsets = [sum(self.sizes[:l]) for l in range(L)]
        self.chan_layer = torch.repeat_interleave(torch.arange(L, device=dev), torch.tensor(self.sizes, device=dev))
        # host copies of `num_batches_tracked`, read once: a momentum of None weighs by it
        nbt = [bn.num_batches_tracked for bn in bns if bn.num_batches_tracked is not None]
        self.nbt_host = [int(v) for v in torch.stack(nbt).tolist()] if any(m is None for m in momenta) and nbt else None
        self.scratch = torch.zeros((), dtype=torch.long, device=dev)   # takes BatchNorm's `num_batches_tracked += 1`
        self.S,self.views,self.cap,self.paused,self.staged = None,[],0,False,staged
        self.grow(cap)
        if staged:   # (layers that run twice in a forward get a second staging slot when they first do)
            self.stage,self.stage_views = None,[]
            self._grow_stage(1)
            self.nbt_now = [None if bn.num_batches_tracked is None else int(bn.num_batches_tracked) for bn in bns]
        self.counts = [[] for _ in bns]   # per layer, the item count of each slot the window holds
        self.pending,self.n_pend = [],[0]*L   # (layer, items) of each forward of the micro-batch in progress; per layer
        self.stash = [None]*L
        self._pin,self._host,self._event = dev.type == 'cuda',None,None

    def grow(self, cap:int):
        "Room for `cap` forwards of every layer in one window (the slots written so far are kept)"
        if cap <= self.cap: return
        S = torch.zeros(cap, 2, sum(self.sizes), device=self.device, dtype=self.dtype)
        if self.S is not None: S[:self.cap].copy_(self.S)
        self.S,self.cap = S,cap
        self.views = [[(S[j, 0, o:o+c], S[j, 1, o:o+c]) for j in range(cap)] for o,c in zip(self.offsets, self.sizes)]

    def _grow_stage(self, cap:int):
        St = torch.zeros(cap, 2, sum(self.sizes), device=self.device, dtype=self.dtype)
        if self.stage is not None: St[:len(self.stage)].copy_(self.stage)
        self.stage = St
        self.stage_views = [[(St[j, 0, o:o+c], St[j, 1, o:o+c]) for j in range(cap)] for o,
                            c in zip(self.offsets, self.sizes)]

    def hooks(self, l:int):
        "Forward pre-hook and hook of layer `l`: its buffers swapped for the next free slot, then put back"
        bank,stash,world = self,self.stash,sync_batchnorm_world(self.bns[l])
        def pre(bn, inp):
            if not bn.training or bank.paused: return
            if bank.staged and world == 1:
                j = bank.n_pend[l]
                if j >= len(bank.stage): bank._grow_stage(j+1)
                m,v = bank.stage_views[l][j]
                x = inp[0]
                with torch.no_grad():   # what BatchNorm's kernel computes: in float32 at least, the unbiased variance
                    var,mean = torch.var_mean(x if x.dtype in (torch.float32, torch.float64) else x.float(),
                                              dim=[0, *range(2, x.ndim)], correction=1)
                    m.copy_(mean); v.copy_(var)
                bank.pending.append((l, x.numel()//bn.num_features)); bank.n_pend[l] += 1
                return
            if bank.staged:
                j = bank.n_pend[l]
                if j >= len(bank.stage): bank._grow_stage(j+1)
                view = bank.stage_views[l][j]
            else:
                j = len(bank.counts[l]) + bank.n_pend[l]
                if j >= bank.cap: bank.grow(max(j+1, 2*bank.cap))
                view = bank.views[l][j]
            b = module_dicts(bn)[0]   # the dict itself: `Module.__setattr__` costs more than the rest of the hook
            stash[l] = (b['running_mean'], b['running_var'], b['num_batches_tracked'])
            b['running_mean'],b['running_var'] = view
            if stash[l][2] is not None: b['num_batches_tracked'] = bank.scratch
        def post(bn, inp, out):
            s = stash[l]
            if s is None: return
            stash[l] = None
            b = module_dicts(bn)[0]
            b['running_mean'],b['running_var'],b['num_batches_tracked'] = s
            bank.pending.append((l, inp[0].numel()//bn.num_features*world)); bank.n_pend[l] += 1
        return pre,post

    def end_micro(self, counted:bool):
        "The micro-batch's backward ran and counts (its slots join the window), or not (they are cleared for reuse)"
        if not self.pending: return
        if self.staged and counted: self._unstage()
        for l,n in self.pending:
            if counted: self.counts[l].append(n)
            # rare (another callback cancelled the backward): its graph is gone, so the slot can be cleared
            elif not self.staged:
                self.n_pend[l] -= 1
                for v in self.views[l][len(self.counts[l]) + self.n_pend[l]]: v.zero_()
        self.pending,self.n_pend = [],[0]*len(self.bns)

    def _unstage(self):
        "`staged`: the micro-batch's staging slots into the window's next slots (one copy where every layer ran once)"
        n,first = self.n_pend,[len(c) for c in self.counts]
        need = max(f+k for f,k in zip(first, n))
        if need > self.cap: self.grow(max(2*self.cap, need))
        if min(n) == max(n) == 1 and min(first) == max(first): self.S[first[0]].copy_(self.stage[0]); return
        for l,(o,c) in enumerate(zip(self.offsets, self.sizes)):
            for i in range(n[l]): self.S[first[l]+i, :, o:o+c].copy_(self.stage[i, :, o:o+c])

    def state(self)->dict:
        "The window's slots so far (between micro-batches: nothing pending)"
        J = max(map(len, self.counts), default=0)
        return dict(S=self.S[:J].clone(), counts=[list(c) for c in self.counts], nbt_host=self.nbt_host,
                    nbt_now=getattr(self, 'nbt_now', None))
    def load_state(self, st:dict):
        J = len(st['S']); self.grow(J)
        with torch.no_grad(): self.S.zero_(); self.S[:J].copy_(st['S'])
        self.counts,self.nbt_host = [list(c) for c in st['counts']],st['nbt_host']
        if st['nbt_now'] is not None: self.nbt_now = st['nbt_now']

    def restore_buffers(self):
        "Put back the buffers of a forward that raised between the two hooks"
        for l,s in enumerate(self.stash):
            if s is not None:
                b = module_dicts(self.bns[l])[0]
                b['running_mean'],b['running_var'],b['num_batches_tracked'] = s; self.stash[l] = None

    @torch.no_grad()
    def close(self, stepped:bool):
        "The window is over: one running-statistics update per layer if it stepped, none if not; the slots are cleared"
        self.end_micro(False)
        J = max(map(len, self.counts), default=0)
        # (over ranks: a rank that ran only padding in the window still takes part, with nothing of its own)
        if stepped and (J or self.over_ranks): self._apply(max(J, 1))
        if J: self.S[:J].zero_()
        self.counts = [[] for _ in self.bns]

    def _apply(self, J:int):
        L = len(self.bns)
        # host side, one (J+1, L) table: item counts per slot and layer, then each layer's lerp weight. A layer with no
        # forward in the window gets a fake count of 2 on its zero slot 0 (finite pooled statistics) and weight 0
        n,ran = [[0.]*L for _ in range(J+1)],self._ran()
        for l,cs in enumerate(self.counts):
            if not cs: n[0][l] = 2.
            if not ran[l]: continue
            for j,c in enumerate(cs): n[j][l] = float(c)
            m = self.momenta[l]
            if m is None: self.nbt_host[l] += 1; m = 1/self.nbt_host[l]
            n[J][l] = m
        host = torch.tensor(n, dtype=torch.float64)
        if self._pin:
            if self._event is not None: self._event.synchronize()   # the last window's copy (long done) read the buffer
            if self._host is None or self._host.shape != host.shape: self._host = torch.empty_like(host).pin_memory()
            self._host.copy_(host); host = self._host
        table = host.to(self.device, non_blocking=True).index_select(1, self.chan_layer)   # (J+1, channels)
        if self._pin: self._event = torch.cuda.Event(); self._event.record()
        st = self.S[:J].double()   # (J, 2, channels)
        mean,var = (self._over_ranks if self.over_ranks else pooled_mean_var)(table[:J], st[:,0], st[:,1])
        rms,rvs = [bn.running_mean for bn in self.bns],[bn.running_var for bn in self.bns]
        new = torch.cat(rms + rvs).view(2, -1).double().lerp_(torch.stack([mean, var]), table[J]).to(self.dtype)
        foreach('copy_')(rms + rvs, list(new.view(-1).split(self.sizes*2)))
        if self.staged:   # the layers counted every forward: one count a window, from the host's tally
            for l,c in enumerate(ran):
                if c and self.nbt_now[l] is not None: self.nbt_now[l] += 1
            self.fix_nbt()
            return
        called = [bn.num_batches_tracked for bn,c in zip(self.bns, ran) if c and bn.num_batches_tracked is not None]
        if called: foreach('add_')(called, 1)

    def _ran(self)->list:
        """Which layers ran in the window: here, or over ranks on any rank (a rank dealt only padding ran none, and
        updates its running statistics from the others' as they do)"""
        ran = [bool(c) for c in self.counts]
        if not self.over_ranks: return ran
        import torch.distributed as dist
        t = torch.tensor(ran, dtype=torch.float32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def _over_ranks(self, n, mean, var)->tuple[torch.Tensor,torch.Tensor]:
        """`pooled_mean_var` of the window over all ranks (`over_ranks`: a `global_window` run, whose window is the same
        samples on any number of processes): each rank's pooled items, mean and m2 gathered, then pooled again. A layer
        that ran on no rank keeps a fake count of 2 on zero statistics (its weight is 0)"""
        import torch.distributed as dist
        ran = torch.tensor([float(bool(c)) for c in self.counts], dtype=n.dtype,
                           device=n.device).index_select(0, self.chan_layer)
        tot,mu,m2 = pooled_moments(n, mean, (n-1).clamp_min(0)*var)
        mine = torch.stack([tot*ran, mu*ran, m2*ran])
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        g = torch.stack(parts)   # (ranks, 3, channels)
        cnt = g[:, 0].clone(); cnt[0] += 2*(cnt.sum(0) == 0)
        tot,mu,m2 = pooled_moments(cnt, g[:, 1], g[:, 2])
        return mu,m2/(tot-1)

    @torch.no_grad()
    def fix_nbt(self):
        "`staged`: every layer's `num_batches_tracked` as one count a stepped window makes (the forwards counted more)"
        for bn,v in zip(self.bns, self.nbt_now):
            if v is not None: bn.num_batches_tracked.fill_(v)

class RecomputeGuard:
    """Activation checkpointing (`torch.utils.checkpoint`, reentrant or not) runs a block's forward again during the
    backward. A BatchNorm layer in training mode then updates its running statistics a second time (pytorch#96136), and
    'pool' would pool the same items twice. While the guard is on (from `before_backward` to `after_backward`: `start`,
    `stop`), the first forward of each layer keeps a copy of its running buffers, put back when the backward is over:
    the recomputation normalises with the micro-batch's statistics as the first forward did, and the running statistics
    count each micro-batch once. (A copy put back, not buffers swapped around the forward: the non-reentrant form stops
    a recomputation as soon as it has what the backward needs, inside the forward, so a forward hook may never run.)
    `recomputed` counts the forwards it caught."""
    def __init__(self, bns:list):
        self.on,self.recomputed,self.kept,self.handles = False,0,{},[]
        for bn in bns:
            if bn.running_mean is not None: self.handles.append(bn.register_forward_pre_hook(self._pre))
    def _pre(self, bn, inp):
        if not (self.on and bn.training): return
        self.recomputed += 1
        if bn not in self.kept:
            self.kept[bn] = [(t, t.clone()) for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
                             if t is not None]
    def start(self): self.stop(); self.on = True
    @torch.no_grad()
    def stop(self):
        "The backward is over (or never finished): every buffer a recomputation wrote is put back"
        self.on = False
        for pairs in self.kept.values():
            for t,v in pairs: t.copy_(v)
        self.kept = {}
    def remove(self):
        self.stop()
        for h in self.handles: h.remove()
        self.handles = []
