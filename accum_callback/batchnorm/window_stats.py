"""BatchNorm with the window's own statistics in training ('window', 'window-approx'): each BatchNorm layer normalises
every micro-batch of a window with the mean and variance of the whole window, as one large batch of the same samples
does, and (exact variant) its backward adds the statistics' own gradient terms as sums over the window, the reductions
torch's `SyncBatchNorm` makes across devices, here across micro-batches.

Inside a window the weights do not move, so the window's statistics can be computed before its first micro-batch:
layer by layer in the order the forward reaches them (layer L's statistics depend on layers < L normalised with the
window's statistics), one no-grad pass over the window's micro-batches each, stopped at the layer measured. The
backward terms (`sum dy` and `sum dy*xhat` per channel) are found from the top down: for layer L, one forward and a
backward from the loss to layer L only (`torch.autograd.grad` to a probe), with the layers above it already exact.
Under DDP the window is every rank's micro-batches together: after each pass the layer's statistics (and the backward
sums) are reduced over the ranks, so that every rank normalises with the statistics of the large batch of all ranks'
samples, as `SyncBatchNorm` does. `WindowStats` is the machinery (used by the mode and by `check_accumulation`'s
replay), `WindowMode` the mode of `BatchNormAccumulation`."""
from __future__ import annotations
import contextlib, warnings

import torch
import torch.distributed as dist
from torch import nn
from fastai.callback.fp16 import MixedPrecision
from fastai.torch_core import find_bs

from ..compat.torch import rngs_kept
from ..core.distributed import is_ddp, is_distributed, process_count, unwrap
from ..core.losses import loss_reduction, micro_items
from ..micro import micro_batching
from ..micro.pieces import piece_bounds, slice_batch
from .precise import pooled_moments
from ..core.protocols import user_stacklevel

__all__ = ['WINDOW_MODES', 'WINDOW_EXACT_MAX_LAYERS', 'WindowStats', 'WindowMode', 'window_bn_layers',
           'window_is_exact']

WINDOW_MODES = ('window', 'window-approx')
WINDOW_EXACT_MAX_LAYERS = 8   # 'window' is exact up to this many BatchNorm layers, then the approximate variant
_PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

def window_bn_layers(model)->list:
    "The BatchNorm layers the window modes treat: torch's BatchNorm1d/2d/3d (`ValueError` for another BatchNorm kind)"
    from .norm_layers import is_batchnorm
    bns = [m for m in model.modules() if is_batchnorm(m)]
    if any(isinstance(m, nn.SyncBatchNorm) for m in bns):
        raise ValueError("BatchNormAccumulation('window'): SyncBatchNorm layers are not normalised with the window's "
                         "statistics: use plain BatchNorm1d/2d/3d (under DDP 'window' pools the window over the ranks)")
    other = sorted({type(m).__name__ for m in bns if type(m) not in _PLAIN})
    if other: raise ValueError(f"BatchNormAccumulation('window'): only torch's BatchNorm1d/2d/3d are normalised with "
                               f"the window's statistics, and the model has {', '.join(other)}: use mode='pool' for it")
    return bns

def window_is_exact(mode:str, n_layers:int)->bool:
    "Is `mode` the exact variant on a model of `n_layers` BatchNorm layers? ('window': up to `WINDOW_EXACT_MAX_LAYERS`)"
    return mode == 'window' and n_layers <= WINDOW_EXACT_MAX_LAYERS

class _Stop(Exception): "The layer being measured is reached: the rest of the forward is not needed"

class _Collect:
    "A statistics pass: the layer it measures (the first the forward reaches without statistics) and its micro-batches'"
    def __init__(self): self.layer,self.parts = None,[]   # parts: (items, mean, m2) per micro-batch

class _Layer:
    "One BatchNorm layer's window state: statistics (float64), the backward sums, and what the passes collect"
    def __init__(self, bn):
        self.bn,self.mean,self.invstd,self.var,self.n = bn,None,None,None,0.
        self.sum_dy = self.sum_dyx = None   # the window's sums (exact variant)
        self.acc,self.calls,self.x,self.m2 = None,0,None,None
    def shape(self, x): return (1, -1) + (1,)*(x.ndim-2)

class _WindowBN(torch.autograd.Function):
    """y = (x - mean)*invstd*weight + bias with the window's mean and invstd; backward as `SyncBatchNorm`'s: dx =
    (dy - sum_dy/N - xhat*sum_dy_xhat/N)*invstd*weight, with the window's sums (exact) or the micro-batch's own
    (approx)"""
    @staticmethod
    def forward(ctx, x, weight, bias, probe, layer, exact):
        sh = layer.shape(x)
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        xhat = (xf - layer.mean.to(xf.dtype).view(sh))*layer.invstd.to(xf.dtype).view(sh)
        y = xhat if weight is None else xhat*weight.to(xf.dtype).view(sh)
        if bias is not None: y = y + bias.to(xf.dtype).view(sh)
        ctx.save_for_backward(x, weight)
        ctx.layer,ctx.exact,ctx.probe,ctx.has_bias = layer,exact,probe is not None,bias is not None
        return y.to(x.dtype)
    @staticmethod
    def backward(ctx, dy):
        x,weight = ctx.saved_tensors
        L = ctx.layer; sh,dims = L.shape(x),[0, *range(2, x.ndim)]
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        dyf = dy.to(xf.dtype)
        invstd = L.invstd.to(xf.dtype)
        xhat = (xf - L.mean.to(xf.dtype).view(sh))*invstd.view(sh)
        s_dy,s_dyx = dyf.sum(dims),(dyf*xhat).sum(dims)
        if L.acc is not None: L.acc[0] += s_dy.double(); L.acc[1] += s_dyx.double()   # a capture pass measures layer L
        if ctx.exact and L.sum_dy is not None: a,b = (L.sum_dy/L.n).to(xf.dtype),(L.sum_dyx/L.n).to(xf.dtype)
        else: n = x.numel()//x.shape[1]; a,b = s_dy/n,s_dyx/n   # the micro-batch's own sums
        scale = invstd if weight is None else invstd*weight.to(xf.dtype)
        dx = ((dyf - a.view(sh) - xhat*b.view(sh))*scale.view(sh)).to(x.dtype)
        dw = s_dyx.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = s_dy.to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, (torch.zeros((), dtype=dy.dtype, device=dy.device) if ctx.probe else None), None, None

class WindowStats:
    """The window's statistics of BatchNorm layers `bns` (torch's BatchNorm1d/2d/3d) and the forward that uses them.
    `prepare(k, run)` measures them over a window of `k` micro-batches, `run(j)` running micro-batch j's forward and
    returning its loss weighted as its backward will be; then, while `on`, every training forward of these layers
    normalises with them (`exact`: the backward with the window's sums too), until the next `prepare`. The running
    statistics are left alone: `update_running()` makes the large batch's one update from the window's statistics.
    `prepare(..., over_ranks=True)` (DDP): the window is every rank's micro-batches, each pass's statistics and sums
    reduced over the default process group; every rank makes the same passes, in the same order"""
    def __init__(self, bns:list, exact:bool):
        self.layers,self.exact,self.on,self.ready = [_Layer(bn) for bn in bns],exact,False,False
        self.order,self.collect,self.probe,self.measured = [],None,None,set()
        self.handles = []
        for L in self.layers:
            self.handles += [L.bn.register_forward_pre_hook(self._pre(L)), L.bn.register_forward_hook(self._post(L))]
        self.preparing,self.passes = False,0   # passes over the window's micro-batches the last `prepare` made

    def _pre(self, L):
        def pre(bn, inp):
            if not (bn.training and (self.on or self.collect is not None)): return
            L.calls += self.preparing   # (counted in the window's passes, which run the training forward)
            if L.calls > 1: raise ValueError("BatchNormAccumulation('window'): a BatchNorm layer runs more than "
                                             "once in a forward, which the window's statistics do not cover: use "
                                             "mode='pool'")
            x = inp[0]
            if self.collect is not None and L not in self.measured:   # the first layer without statistics: measure it
                with torch.no_grad():
                    var,mean = torch.var_mean(x.double(), dim=[0, *range(2, x.ndim)], correction=0)
                n = x.numel()//x.shape[1]
                self.collect.parts.append((n, mean, var*n)); self.collect.layer = L
                raise _Stop()
            L.x = x
            bn.training = False   # an empty eval forward in place of the layer's own (no statistics of it are kept)
            return (x[:0], *inp[1:])
        return pre
    def _post(self, L):
        def post(bn, inp, out):
            x = getattr(L, 'x', None)
            if x is None: return
            L.x = None; bn.training = True
            probe = self.probe if self.probe is not None and self.probe[0] is L else None
            return _WindowBN.apply(x, bn.weight, bn.bias, probe[1] if probe else None, L, self.exact)
        return post

    def _forward(self, run, j, grad=False):
        for L in self.layers: L.calls = 0
        with torch.set_grad_enabled(grad):
            try: return run(j)
            except _Stop: return None
            finally:
                for L in self.layers:
                    if getattr(L, 'x', None) is not None: L.x = None; L.bn.training = True   # (a forward that raised)

    def prepare(self, k:int, run, over_ranks:bool=False):
        """Measure the window's statistics over its `k` micro-batches (`run(j)`: micro-batch j's forward, its weighted
        loss returned), then the backward sums from the top (exact); every RNG as it was after. `over_ranks`: the window
        is every rank's micro-batches (`k` this rank's), its statistics and sums reduced over the ranks"""
        for L in self.layers: L.mean = L.invstd = L.sum_dy = L.sum_dyx = None; L.n = 0.
        self.order,self.measured,self.ready,self.passes = [],set(),False,0
        was_on,self.on,self.preparing = self.on,True,True
        try:
            with rngs_kept():
                while len(self.measured) < len(self.layers):
                    self.collect = _Collect()
                    for j in range(k): self._forward(run, j)
                    self.passes += 1
                    L,parts,self.collect = self.collect.layer,self.collect.parts,None
                    if over_ranks: self._same_layer(L)
                    if L is None: break   # the forward reached no layer left: the others do not run
                    self._set_stats(L, parts, over_ranks)
                if self.exact:
                    for L in reversed(self.order):
                        L.acc = [torch.zeros_like(L.mean), torch.zeros_like(L.mean)]
                        probe = torch.zeros((), requires_grad=True, device=L.mean.device)
                        self.probe = (L, probe)
                        try:
                            for j in range(k):
                                loss = self._forward(run, j, grad=True)
                                if loss is not None and loss.requires_grad:
                                    torch.autograd.grad(loss, [probe], allow_unused=True)   # (to layer L only)
                            self.passes += 1
                        finally: self.probe = None
                        sums = torch.stack(L.acc)
                        if over_ranks: dist.all_reduce(sums)   # (every rank's dy is the same loss's: one reference)
                        L.sum_dy,L.sum_dyx,L.acc = sums[0],sums[1],None
        finally: self.collect,self.on,self.preparing = None,was_on,False
        self.ready = True

    def _same_layer(self, L):
        "Every rank's pass measured the same layer (or none): else the ranks' windows cannot be pooled"
        dev = next((t.device for M in self.layers for t in (*M.bn.parameters(), *M.bn.buffers())), 'cpu')
        mine = torch.tensor([float(self.layers.index(L) if L is not None else -1)], dtype=torch.float64, device=dev)
        got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(got, mine)
        if len({float(g) for g in got}) > 1:
            raise RuntimeError("BatchNormAccumulation('window') under DDP: the ranks' forwards reach their BatchNorm "
                               "layers in different orders, so the window's statistics cannot be pooled over them: use "
                               "mode='pool'")

    def _set_stats(self, L, parts, over_ranks=False):
        n = torch.tensor([float(p[0]) for p in parts], dtype=torch.float64, device=parts[0][1].device)[:, None]
        means,m2s = torch.stack([p[1] for p in parts]),torch.stack([p[2] for p in parts])
        tot,mu,m2 = pooled_moments(n.expand(-1, means.shape[1]), means, m2s)
        if over_ranks:   # each rank's (items, mean, m2) gathered and pooled again in rank order: alike on every rank
            mine = torch.stack([tot, mu, m2])
            got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(got, mine)
            g = torch.stack(got)
            tot,mu,m2 = pooled_moments(g[:, 0], g[:, 1], g[:, 2])
        L.n,L.mean = float(tot[0]),mu
        L.var = m2/tot
        L.invstd = (L.var + L.bn.eps).rsqrt()
        L.m2 = m2
        self.order.append(L); self.measured.add(L)

    @torch.no_grad()
    def update_running(self):
        "The running-statistics update one large batch of the window makes (momentum None: the cumulative average)"
        for L in self.order:
            bn = L.bn
            if bn.running_mean is None: continue
            if bn.num_batches_tracked is not None: bn.num_batches_tracked.add_(1)
            m = bn.momentum if bn.momentum is not None else 1/float(bn.num_batches_tracked)
            unbiased = L.m2/max(L.n-1, 1.)
            bn.running_mean.copy_(bn.running_mean.double().lerp(L.mean, m).to(bn.running_mean.dtype))
            bn.running_var.copy_(bn.running_var.double().lerp(unbiased, m).to(bn.running_var.dtype))

    def state(self)->dict|None:
        "The window's statistics and sums (a checkpoint between its micro-batches), by layer"
        if not self.ready: return None
        idx = {id(L): i for i,L in enumerate(self.layers)}
        return dict(order=[idx[id(L)] for L in self.order],
                    stats=[[L.mean, L.var, L.m2, torch.tensor(L.n, dtype=torch.float64), L.sum_dy, L.sum_dyx]
                           for L in self.order])
    def load_state(self, st:dict|None):
        self.ready,self.order = False,[]
        if st is None: return
        for i,(mean,var,m2,n,sdy,sdx) in zip(st['order'], st['stats']):
            L = self.layers[i]
            L.mean,L.var,L.m2,L.n,L.sum_dy,L.sum_dyx = mean,var,m2,float(n),sdy,sdx
            L.invstd = (var + L.bn.eps).rsqrt()
            self.order.append(L)
        self.measured,self.ready = set(self.order),True

    def remove(self):
        for h in self.handles: h.remove()
        self.handles,self.on = [],False

def _weighted_loss(learn, model, ga, xb, yb, ref):
    "Micro-batch (xb, yb)'s loss through `model`, weighted as `GradientAccumulation` weighs its backward"
    pred = model(*xb)
    loss = learn.loss_func(pred, *yb)
    if ref is None: return loss   # a summed loss: weight 1
    n = micro_items(_Batch(learn, xb, yb, pred, loss), ga.n_items, find_bs(yb if len(yb) else xb))
    return loss*(n/ref)

class _Batch:
    "The Learner as a micro-batch's `n_items` reads it: its xb, yb, pred and loss those of the micro-batch given"
    def __init__(self, learn, xb, yb, pred, loss):
        self.__dict__.update(_learn=learn, xb=xb, yb=yb, pred=pred, loss=loss, loss_grad=loss)
    def __getattr__(self, k): return getattr(self.__dict__['_learn'], k)

class WindowMode:
    """`BatchNormAccumulation('window')`/`('window-approx')`: every BatchNorm layer normalises each micro-batch with the
    statistics of its whole window (`WindowStats`), measured at the window's first micro-batch. A window is one loader
    batch cut by `MicroBatching(size)`: its micro-batches are known at its start. 'window' is exact (the backward's
    window sums too: the large batch's gradient) up to `WINDOW_EXACT_MAX_LAYERS` BatchNorm layers and says so where it
    falls back; 'window-approx' keeps the window's statistics in the forward and leaves out of the backward what the
    other micro-batches add to the statistics' gradient terms (each micro-batch's own sums stand in for the window's).
    `variant` says which is in force."""
    needs_windows = True
    def __init__(self, cb): self.cb,self.ws,self.variant = cb,None,None

    @staticmethod
    def refuse(learn, mode:str):
        """Before anything is set up: the windows this mode can measure (one loader batch cut by `MicroBatching`; under
        DDP one on every rank), not FSDP2 nor a `global_window` run over several processes"""
        from ..window.accumulate import GradientAccumulation
        from .norm_layers import is_batchnorm
        if not any(is_batchnorm(m) for m in learn.model.modules()): return   # (nothing to measure: said at fit start)
        ga = next((cb for cb in learn.cbs if isinstance(cb, GradientAccumulation)), None)
        mb = micro_batching(learn)
        fix = ("load a window as one loader batch and cut it: `bs=<window's items>` in the loaders, "
               "`MicroBatching(<micro-batch size>)` and `GradientAccumulation(n_step=1)`")
        if mb is None or mb.auto or not mb.size:
            auto = " (a fixed size, not 'auto')" if mb is not None and mb.auto else ""
            raise ValueError(f"BatchNormAccumulation({mode!r}) measures the window's statistics at its start, so it "
                             f"needs its micro-batches then: {fix}{auto}")
        bs = getattr(learn.dls.train, 'bs', None)
        if ga is not None and bs and ga.window_batches(bs) != 1:
            raise ValueError(f"BatchNormAccumulation({mode!r}): a window of several loader batches cannot be measured "
                             f"at its start: {fix}")
        if is_distributed(learn.model) and not is_ddp(learn.model):
            raise ValueError(f"BatchNormAccumulation({mode!r}) is not implemented under FSDP2 yet: use mode='pool' "
                             "(or DDP)")
        if ga is not None and ga.window_over_ranks and process_count() > 1:
            raise ValueError(f"BatchNormAccumulation({mode!r}) is not implemented for a `global_window` run over "
                             "several processes yet: use mode='pool' (or DDP without `global_window`)")

    def start(self, bns):
        bns = window_bn_layers(self.cb.model)
        exact = window_is_exact(self.cb.mode, len(bns))
        self.variant = self.cb.window_variant = 'exact' if exact else 'approx'   # (the callback says it after fit)
        if self.cb.mode == 'window' and not exact:
            warnings.warn(f"BatchNormAccumulation('window'): {len(bns)} BatchNorm layers, more than "
                          f"{WINDOW_EXACT_MAX_LAYERS}: the approximate variant is in force (window statistics in the "
                          "forward; the backward's statistics terms from each micro-batch's own sums), as "
                          "'window-approx'",
                          stacklevel=user_stacklevel())
        self.ws = WindowStats(bns, exact)
        self.mb = micro_batching(self.cb.learn)

    def before_train(self): pass
    def before_batch(self):
        learn,ga,ws = self.cb.learn,self.cb.ga,self.ws
        p = self.mb.piece
        ws.on = True
        if p is None or p.start != 0: return
        if ga.window.n_micro or ga.window.n_units != 1:
            raise RuntimeError(f"BatchNormAccumulation({self.cb.mode!r}): a window of several loader batches cannot be "
                               "measured at its start: accumulate one loader batch a window "
                               "(GradientAccumulation(n_step=1))")
        b = self.mb.loader.batch
        i = getattr(learn.dls, 'n_inp', 1)   # (as fastai's loop splits a batch)
        pieces = [slice_batch(b, s, e) for s,e in piece_bounds(find_bs(b), self.mb.size)]
        xys = [(tuple(q[:i]), tuple(q[i:])) for q in pieces]
        summed,self._refv = loss_reduction(learn.loss_func) == 'sum',None
        # as the training forward and backward run: under `MixedPrecision`'s autocast, the loss scaled by its scaler
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        ctx = mp.autocast if getattr(mp, 'autocast', None) is not None else contextlib.nullcontext()
        scaler = getattr(learn, 'scaler', None) if mp is not None else None
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.
        # under DDP: through the wrapped module (no reducer, no buffer broadcast), the window pooled over the ranks
        ddp = is_ddp(learn.model)
        model = unwrap(learn.model)
        def run(j):
            with ctx: loss = _weighted_loss(learn, model, ga, *xys[j], None if summed else self._ref(xys, ddp))
            return loss if scale == 1. else loss*scale
        ws.prepare(len(xys), run, over_ranks=ddp)
    def _ref(self, xys, ddp:bool):
        "The window's loss-scale reference: its first micro-batch's count, under DDP the loader's bs"
        if self._refv is None:
            learn,ga = self.cb.learn,self.cb.ga
            xb,yb = xys[0]
            from ..window.state import Window
            n = micro_items(_Batch(learn, xb, yb, None, None), ga.n_items, find_bs(yb if len(yb) else xb))
            self._refv = Window.reference(float(n) if not isinstance(n, torch.Tensor) else n,
                                          learn.dls.train.bs if ddp else None)
        return self._refv
    def before_backward(self): pass
    def after_backward(self): self.ws.on = False   # (the backward is over: other forwards run as they would)
    def micro_undone(self): pass
    def window_closed(self, stepped:bool):
        if stepped and self.ws.ready: self.ws.update_running()
        self.ws.ready = False
    def state(self): return self.ws.state() if self.ws is not None else None
    def load_state(self, st): self.ws.load_state(st)
    def restore(self):
        if self.ws is not None: self.ws.remove()
        self.ws = None
