"BatchNorm under gradient accumulation: pooled running statistics, the momentum rule, frozen statistics, GroupNorm, Batch Renorm"
from __future__ import annotations
import functools, warnings
from numbers import Real

import torch, torch.nn as nn, torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
import torch.distributed as dist
from fastai.callback.core import Callback
from fastcore.basics import store_attr

from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation

from .accumulate import GradientAccumulation
from .schedule import _whole
from .guard import CANCELS, add_fit_guard, remove_fit_guard, in_inference

__all__ = ['BatchNormAccumulation', 'BN_MODES', 'accumulated_momentum', 'BatchRenorm', 'BatchRenorm1d', 'BatchRenorm2d',
           'BatchRenorm3d', 'bn_to_groupnorm', 'bn_to_batchrenorm']

BN_MODES = ('pool', 'momentum', 'freeze', 'groupnorm', 'renorm')
_NEEDS_GA = ('pool', 'momentum')   # modes that read the window structure

def _real(v, name:str, lo:float)->float:
    if isinstance(v, bool) or not isinstance(v, Real): raise TypeError(f"`{name}` must be a number >= {lo}, got {v!r}")
    if not v >= lo: raise ValueError(f"`{name}` must be >= {lo}, got {v}")
    return float(v)

def accumulated_momentum(
    m:float|None, # a BatchNorm momentum (None: cumulative average, left as is)
    k:int, # micro-batches per optimizer step
)->float|None:
    """The per-micro-batch momentum whose `k` updates weigh the old running statistics as one update with `m` does:
    `1-(1-m)**(1/k)`, so `(1-accumulated_momentum(m, k))**k == 1-m`.

    >>> round(accumulated_momentum(0.1, 4), 6)
    0.025996
    """
    k = _whole(k, 'k')
    if m is None: return None
    if isinstance(m, bool) or not isinstance(m, Real) or not 0 <= m <= 1: raise ValueError(f"`m` must be in [0, 1] or None, got {m!r}")
    return 1 - (1-float(m))**(1/k)

# -- module conversion ------------------------------------------------------------------------------------------------
def _convert(module:nn.Module, fn, name:str='', memo=None)->nn.Module:
    "Replace each `_BatchNorm` below (or at) `module` by `fn(bn, name)`; a layer shared by several parents stays shared"
    memo = {} if memo is None else memo
    if _is_bn(module):
        if id(module) not in memo: memo[id(module)] = fn(module, name or '<root>')
        return memo[id(module)]
    for n,child in list(module._modules.items()):   # not `named_children`, which skips a module's second name
        if child is None: continue
        new = _convert(child, fn, f'{name}.{n}' if name else n, memo)
        if new is not child: module.add_module(n, new)
    return module

def _is_bn(m)->bool: "A BatchNorm layer to convert or treat (a `BatchRenorm` is one to fastai, not to us)"; return isinstance(m, _BatchNorm) and not isinstance(m, BatchRenorm)

def _factory(bn)->dict:
    t = next((t for t in (bn.weight, bn.running_mean) if t is not None), None)
    return {} if t is None else dict(device=t.device, dtype=t.dtype)

def _has_stats(bn)->bool:
    "Does `bn` hold running statistics other than the ones it was initialised with?"
    if bn.running_mean is None: return False
    nbt = bn.num_batches_tracked
    return bool((nbt is not None and nbt > 0) or bn.running_mean.ne(0).any() or bn.running_var.ne(1).any())

def _groups(c:int, num_groups:int)->int: return max(g for g in range(1, min(c, num_groups)+1) if c % g == 0)

def bn_to_groupnorm(
    module:nn.Module, # a model (or a single BatchNorm layer)
    num_groups:int=32, # most groups per layer: each layer gets the largest count <= this that divides its channels
)->nn.Module:
    """Replace every BatchNorm (1d/2d/3d, SyncBatchNorm) in `module` by `nn.GroupNorm`, in place, and return the root
    (a new module only when `module` itself is a BatchNorm). The GroupNorm reuses the BatchNorm's own `weight` and `bias`
    Parameter objects, so an optimizer, fastai param groups, freeze/unfreeze and discriminative learning rates built
    on the model keep working; device, dtype, `training` and `requires_grad` are kept. Running statistics are
    discarded: one warning when any were not at their initial values.

    GroupNorm accepts `(N,C)` input too (a `BatchNorm1d` head): each group is then normalised over its `C/groups`
    channels of one sample, so a group of one channel gives just the bias (a warning names such `BatchNorm1d` layers).

    >>> from torchvision.models import resnet18
    >>> m = bn_to_groupnorm(resnet18(weights=None))
    >>> type(m.bn1).__name__, m.bn1.num_groups, m.layer4[0].bn2.num_channels
    ('GroupNorm', 32, 512)
    """
    num_groups = _whole(num_groups, 'num_groups')
    stats,single = [],[]
    def fn(bn, name):
        g = _groups(bn.num_features, num_groups)
        gn = (GroupNormAct if _is_norm_act(bn) else nn.GroupNorm)(g, bn.num_features, eps=bn.eps, affine=bn.affine, **_factory(bn))
        if bn.affine: gn.weight,gn.bias = bn.weight,bn.bias
        _keep_act(bn, gn)
        gn._from_bn = True   # lets `BatchNormAccumulation` give it fastai's BatchNorm treatment (train_bn, wd_bn_bias)
        if _has_stats(bn): stats.append(name)
        if isinstance(bn, nn.BatchNorm1d) and g == bn.num_features: single.append(name)
        return gn.train(bn.training)
    res = _convert(module, fn)
    if stats: warnings.warn(f"bn_to_groupnorm: running statistics of {len(stats)} BatchNorm layer(s) (e.g. {stats[0]}) "
                            "are discarded: GroupNorm normalises with per-sample statistics only", stacklevel=2)
    if single: warnings.warn(f"bn_to_groupnorm: {single} got one channel per group: on (N,C) input such a GroupNorm "
                             "outputs only its bias; give a smaller `num_groups`", stacklevel=2)
    return res

class BatchRenorm(_BatchNorm):
    """Batch Renormalization (Ioffe, 2017) for (N,C), (N,C,L), (N,C,H,W) or (N,C,D,H,W) input: a `_BatchNorm` with
    BatchNorm's parameters, buffers and state-dict keys. Training normalises with the batch statistics corrected towards
    the running ones, `(x-mean_B)/std_B*r + d`, with `r = std_B/std` clipped to [1/r_max, r_max] and `d = (mean_B-mean)/std`
    clipped to [-d_max, d_max], both without gradient; evaluation is exactly BatchNorm's. `r_max`, `d_max` start at 1, 0
    (plain BatchNorm) for `warmup` training forwards, then ramp linearly to their values over `ramp` forwards.
    `BatchRenorm1d/2d/3d` are also `nn.BatchNorm1d/2d/3d`, so fastai treats them as BatchNorm (`BnFreeze`, `train_bn`,
    `wd_bn_bias`); the converters pick the one matching the layer they replace."""
    def __init__(self,
        num_features:int, # channels C
        eps:float=1e-5, # added to the variance
        momentum:float|None=0.1, # running-statistics momentum (None: cumulative average), as in BatchNorm
        affine:bool=True, # learn a per-channel weight and bias
        track_running_stats:bool=True, # keep running statistics (else batch statistics always, as BatchNorm)
        r_max:float=3., # largest std correction once ramped (>= 1)
        d_max:float=5., # largest mean correction, in running stds, once ramped (>= 0)
        warmup:int=0, # training forwards with r_max=1, d_max=0 (plain BatchNorm) first
        ramp:int=5000, # training forwards over which r_max, d_max then grow linearly to their values
        device=None, dtype=None):
        num_features = _whole(num_features, 'num_features')
        r_max,d_max,warmup,ramp = _real(r_max, 'r_max', 1.),_real(d_max, 'd_max', 0.),_whole(warmup, 'warmup', lo=0),_whole(ramp, 'ramp', lo=0)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.r_max,self.d_max,self.warmup,self.ramp = r_max,d_max,warmup,ramp
        self.renorm_steps = 0   # training forwards since creation: drives the ramp (not in the state dict)

    def _check_input_dim(self, x):
        if x.dim() not in (2,3,4,5): raise ValueError(f"BatchRenorm expects (N,C), (N,C,L), (N,C,H,W) or (N,C,D,H,W) input, got {x.dim()}-D")

    def limits(self)->tuple[float,float]:
        "`(r_max, d_max)` in force now"
        t = self.renorm_steps - self.warmup
        f = 0. if t < 0 else (1. if self.ramp == 0 else min(1., t/self.ramp))
        return 1 + (self.r_max-1)*f, self.d_max*f

    def forward(self, x:torch.Tensor)->torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features: raise ValueError(f"BatchRenorm({self.num_features}) got {x.shape[1]} channels")
        rm,rv = self.running_mean,self.running_var
        if not (self.training and self.track_running_stats and rm is not None):
            # BatchNorm's own paths: evaluation with running statistics, or batch statistics without them
            use = not self.training or self.track_running_stats
            return F.batch_norm(x, rm if use else None, rv if use else None, self.weight, self.bias,
                                self.training or rm is None, 0., self.eps)
        n = x.numel() // x.shape[1]
        if n < 2: raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        r_max,d_max = self.limits()
        self.renorm_steps += 1
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        with torch.no_grad():   # r and d are constants to the backward (Ioffe 2017); the batch statistics are not
            var,mean = torch.var_mean(xf, dim=[0, *range(2, x.dim())], correction=0)
            std,rstd = (var + self.eps).sqrt(),(rv + self.eps).sqrt()
            r = (std/rstd).clamp_(1/r_max, r_max)
            d = ((mean-rm)/rstd).clamp_(-d_max, d_max)
            self.num_batches_tracked.add_(1)
            m = 1/float(self.num_batches_tracked) if self.momentum is None else self.momentum
            rm.lerp_(mean.to(rm.dtype), m); rv.lerp_((var*(n/(n-1))).to(rv.dtype), m)
        # (x-mean_B)/std_B*r + d, then the affine: BatchNorm's fused kernel with weight w*r and bias w*d + b computes it,
        # differentiating through the batch statistics as Batch Renorm does (1.25x BatchNorm here, 1.46x unfused)
        w,b = (self.weight, self.bias) if self.affine else (1., 0.)
        return F.batch_norm(xf, None, None, w*r, w*d + b, True, 0., self.eps).to(x.dtype)

    def extra_repr(self)->str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}, r_max={self.r_max}, d_max={self.d_max}, "
                f"warmup={self.warmup}, ramp={self.ramp}")

# timm's norm-act layers (`BatchNormAct2d`, a BatchNorm2d subclass used by EfficientNet, RegNet, ...) apply dropout and
# an activation after normalising: a conversion that dropped them would silently change the network.
def _is_norm_act(bn)->bool: return isinstance(getattr(bn, 'act', None), nn.Module) and isinstance(getattr(bn, 'drop', None), nn.Module)
def _keep_act(bn, new):
    if _is_norm_act(bn): new.drop,new.act = bn.drop,bn.act

class _NormAct:
    "Normalise, then the dropout and activation the converted timm norm-act layer carried (same state-dict keys)"
    def forward(self, x): return self.act(self.drop(super().forward(x)))

class BatchRenorm1d(BatchRenorm, nn.BatchNorm1d):
    "`BatchRenorm` for (N,C) or (N,C,L) input; an `nn.BatchNorm1d` to fastai"
    def _check_input_dim(self, x): nn.BatchNorm1d._check_input_dim(self, x)
class BatchRenorm2d(BatchRenorm, nn.BatchNorm2d):
    "`BatchRenorm` for (N,C,H,W) input; an `nn.BatchNorm2d` to fastai"
    def _check_input_dim(self, x): nn.BatchNorm2d._check_input_dim(self, x)
class BatchRenorm3d(BatchRenorm, nn.BatchNorm3d):
    "`BatchRenorm` for (N,C,D,H,W) input; an `nn.BatchNorm3d` to fastai"
    def _check_input_dim(self, x): nn.BatchNorm3d._check_input_dim(self, x)

class GroupNormAct(_NormAct, nn.GroupNorm): "`nn.GroupNorm` followed by the `drop` and `act` of a converted timm norm-act layer"
class BatchRenormAct(_NormAct, BatchRenorm): "`BatchRenorm` followed by the `drop` and `act` of a converted timm norm-act layer"
class BatchRenormAct2d(_NormAct, BatchRenorm2d): "`BatchRenorm2d` followed by the `drop` and `act` of a converted timm norm-act layer"

def _renorm_cls(bn):
    "The BatchRenorm class that replaces `bn`: the same BatchNorm dimension, so fastai's type checks still match"
    act = _is_norm_act(bn)
    if isinstance(bn, nn.BatchNorm2d): return BatchRenormAct2d if act else BatchRenorm2d
    if act: return BatchRenormAct
    if isinstance(bn, nn.BatchNorm1d): return BatchRenorm1d
    if isinstance(bn, nn.BatchNorm3d): return BatchRenorm3d
    return BatchRenorm   # SyncBatchNorm and other _BatchNorm subclasses: any dimension

def bn_to_batchrenorm(
    module:nn.Module, # a model (or a single BatchNorm layer)
    r_max:float=3., # largest std correction once ramped
    d_max:float=5., # largest mean correction once ramped
    warmup:int=0, # training forwards as plain BatchNorm first
    ramp:int=5000, # training forwards over which the limits then grow from 1, 0 to `r_max`, `d_max`
)->nn.Module:
    """Replace every BatchNorm (1d/2d/3d, SyncBatchNorm) in `module` by `BatchRenorm`, in place, and return the root (a
    new module only when `module` itself is a BatchNorm). The new layers reuse the BatchNorm's `weight`/`bias`
    Parameter objects and its running-statistics buffers (pretrained statistics are kept, so the model's eval output
    is unchanged) and keep eps, momentum, `training`, device and dtype.

    >>> import torch
    >>> from torchvision.models import resnet18
    >>> m = resnet18(weights=None).eval(); x = torch.randn(2, 3, 32, 32); y = m(x)
    >>> m = bn_to_batchrenorm(m, r_max=3., d_max=5., ramp=1000)
    >>> torch.equal(m(x), y), type(m.bn1).__name__
    (True, 'BatchRenorm')
    """
    kw = dict(r_max=r_max, d_max=d_max, warmup=warmup, ramp=ramp)
    BatchRenorm(1, **kw)   # validate before touching the model
    def fn(bn, name):
        new = _renorm_cls(bn)(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, **kw, **_factory(bn))
        if bn.affine: new.weight,new.bias = bn.weight,bn.bias
        _keep_act(bn, new)
        new.running_mean,new.running_var,new.num_batches_tracked = bn.running_mean,bn.running_var,bn.num_batches_tracked
        return new.train(bn.training)
    return _convert(module, fn)

# -- the callback -----------------------------------------------------------------------------------------------------
class BatchNormAccumulation(Callback):
    """Make BatchNorm behave under gradient accumulation. `mode`:
    'pool': one running-statistics update per optimizer step, from the statistics pooled over every micro-batch of the
      window: the running statistics one large batch of the same samples leaves. The forward still normalises each
      micro-batch with its own statistics (ghost batch norm). A window that is not stepped (dropped, skipped as
      non-finite, step cancelled) updates nothing; a layer called several times per forward pools all calls.
    'momentum': each BatchNorm momentum m becomes `accumulated_momentum(m, k)` during fit, k micro-batches per window.
    'freeze': BatchNorm layers use their running statistics in training too; affine parameters train if `train_affine`.
    'groupnorm': BatchNorm layers become GroupNorm (`bn_to_groupnorm`) at the start of fit.
    'renorm': BatchNorm layers become `BatchRenorm` (`bn_to_batchrenorm`) at the start of fit."""
    order,run_valid,_only_train_loop = GradientAccumulation.order+1,False,True   # reads `GradientAccumulation`'s window

    def __init__(self,
        mode:str='pool', # one of `BN_MODES`
        *,
        train_affine:bool=True, # 'freeze': keep training the BatchNorm weight and bias
        num_groups:int=32, # 'groupnorm': most groups per layer
        r_max:float=3., d_max:float=5., warmup:int=0, ramp:int=5000, # 'renorm': see `BatchRenorm`
    ):
        if not isinstance(mode, str) or mode not in BN_MODES: raise ValueError(f"`mode` must be one of {BN_MODES}, got {mode!r}")
        if not isinstance(train_affine, bool): raise TypeError(f"`train_affine` must be True or False, got {train_affine!r}")
        _whole(num_groups, 'num_groups'); BatchRenorm(1, r_max=r_max, d_max=d_max, warmup=warmup, ramp=ramp)
        store_attr()
        self._saved_mom,self._saved_rg,self._hooks = [],[],[]
        self._frozen,self._pend,self._win,self._stash,self._warned = [],[],[],{},False

    # -- fit --------------------------------------------------------------------------------------------------------
    def before_fit(self):
        # `validate`/`get_preds`/`predict` send `before_fit` too, holding the Learner's lock: no conversion, no hooks and
        # no raise there (a raise would leave the lock held); everything happens when training starts
        if in_inference(self.learn): return
        self._restore()   # whatever an interrupted fit left behind
        self._ga = next((cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation)), None)
        if self._ga is None and self.mode in _NEEDS_GA:
            other = any(isinstance(cb, FastaiGradientAccumulation) for cb in self.learn.cbs)
            raise ValueError(f"BatchNormAccumulation(mode={self.mode!r}) reads the accumulation windows from "
                             "`accum_callback.GradientAccumulation`, which is not in this fit" +
                             (" (fastai's `fastai.callback.training.GradientAccumulation` is, and has no windows to read)" if other else "") +
                             ": add `accum_callback.GradientAccumulation(n_step=...)` to the Learner's callbacks or to this "
                             "`fit(cbs=...)`, or call `learn.accumulate(...)`")
        bns = [m for m in self.model.modules() if _is_bn(m)]
        if self.mode in ('groupnorm', 'renorm'):
            if bns: self._convert()
            elif not any(getattr(m, '_from_bn', False) or isinstance(m, BatchRenorm) for m in self.model.modules()): self._warn_none()
            self._tag_norm_params()
            return
        if not bns: return self._warn_none()
        getattr(self, f'_start_{self.mode}')(bns)
        add_fit_guard(self.learn, 'batch_norm_accumulation', lambda e: isinstance(e, CANCELS) or self._restore())

    def after_fit(self):
        if not in_inference(self.learn): self._restore()

    def _warn_none(self):
        if not self._warned: warnings.warn(f"BatchNormAccumulation(mode={self.mode!r}): the model has no BatchNorm layer; "
                                           "nothing changed", stacklevel=2)
        self._warned = True

    def _restore(self):
        "Put back momentum, train/eval mode and requires_grad, remove the hooks and forget any window"
        for h in self._hooks: h.remove()
        for bn,m in self._saved_mom: bn.momentum = m
        for bn,(rm,rv,_) in self._stash.items(): bn.running_mean,bn.running_var = rm,rv   # a forward raised in between
        for p,rg in self._saved_rg: p.requires_grad_(rg)
        # the mode the training loop left the model in (eval after validation), as it would be without this callback
        for bn in self._frozen: bn.train(getattr(self.learn, 'model', bn).training)
        self._hooks,self._saved_mom,self._saved_rg,self._frozen = [],[],[],[]
        if getattr(self, '_ga', None) is not None: self._ga.remove_window_listener(self._window_closed)
        self._pend.clear(); self._win.clear(); self._stash.clear()
        remove_fit_guard(self.learn, 'batch_norm_accumulation')

    # -- 'pool' -----------------------------------------------------------------------------------------------------
    def _start_pool(self, bns):
        for bn in bns:
            if bn.running_mean is None: continue   # no running statistics to pool
            self._saved_mom.append((bn, bn.momentum))
            bn.momentum = 1.   # after a forward the buffers hold exactly that batch's mean and unbiased variance
            self._hooks += [bn.register_forward_pre_hook(self._pre_hook), bn.register_forward_hook(self._post_hook)]
        self._mom = dict(self._saved_mom)
        self._ga.on_window_close(self._window_closed)

    # Autograd saves the running buffers a BatchNorm forward used: they must not change in place until the backward.
    # So each training forward gets fresh zero buffers (one (2,C) tensor) to write its statistics into; the real ones
    # are put back after. The buffer dict is used directly: `Module.__setattr__` costs more than the rest of the hook.
    def _pre_hook(self, bn, inp):
        if not (bn.training and bn.track_running_stats): return
        b = bn._buffers; rm = b['running_mean']
        z = rm.new_zeros(2, rm.shape[0])
        self._stash[bn] = (rm, b['running_var'], z)
        b['running_mean'],b['running_var'] = z[0],z[1]

    def _post_hook(self, bn, inp, out):
        s = self._stash.pop(bn, None)
        if s is None: return
        b = bn._buffers
        b['running_mean'],b['running_var'] = s[0],s[1]
        n = inp[0].numel()//bn.num_features
        # SyncBatchNorm wrote statistics over every rank's micro-batch: count them all (ranks of equal micro-batch size)
        if isinstance(bn, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized(): n *= dist.get_world_size(bn.process_group)
        self._pend.append((bn, n, s[2]))
        if b['num_batches_tracked'] is not None: b['num_batches_tracked'].sub_(1)

    # -- 'momentum' -------------------------------------------------------------------------------------------------
    def _start_momentum(self, bns):
        self._saved_mom,self._k = [(bn, bn.momentum) for bn in bns if bn.momentum is not None],None

    # -- 'freeze' ---------------------------------------------------------------------------------------------------
    def _start_freeze(self, bns):
        self._frozen = bns
        if not self.train_affine:
            ps = [p for bn in bns for p in (bn.weight, bn.bias) if p is not None]
            self._saved_rg = [(p, p.requires_grad) for p in ps]
            for p in ps: p.requires_grad_(False)
        if any(bn.running_mean is None for bn in bns):
            warnings.warn("BatchNormAccumulation('freeze'): BatchNorm layers with track_running_stats=False have no "
                          "running statistics and keep normalising with batch statistics", stacklevel=3)

    def before_train(self):
        for bn in self._frozen: bn.eval()   # after `TrainEvalCallback` put the whole model in train mode

    # -- 'groupnorm' / 'renorm' -------------------------------------------------------------------------------------
    def _convert(self):
        if self.mode == 'groupnorm': new = bn_to_groupnorm(self.model, self.num_groups)
        else: new = bn_to_batchrenorm(self.model, r_max=self.r_max, d_max=self.d_max, warmup=self.warmup, ramp=self.ramp)
        if new is not self.model: self.learn.model = new   # the root itself was a BatchNorm
        # the Parameter objects are the BatchNorm's own, so the optimizer built at the start of `fit` keeps working

    def _tag_norm_params(self):
        "fastai picks BatchNorm parameters by type for `train_bn`/`wd_bn_bias`: give converted layers the same treatment"
        opt = getattr(self.learn, 'opt', None)
        if opt is None: return
        ps = {id(p) for m in self.model.modules() if getattr(m, '_from_bn', False) or isinstance(m, BatchRenorm)
              for p in m.parameters()}
        for p,_,state,_ in opt.all_params():
            if id(p) not in ps: continue
            if not getattr(self.learn, 'wd_bn_bias', False): state['do_wd'] = False
            if getattr(self.learn, 'train_bn', True) and not state.get('force_train'): state['force_train'] = True; p.requires_grad_(True)

    # -- batch ------------------------------------------------------------------------------------------------------
    def before_batch(self):
        if self.mode == 'pool': self._pend.clear()   # statistics of a micro-batch cancelled before its backward
        elif self.mode == 'momentum' and self._saved_mom and self._ga.window_start:
            k = self._ga.window_n_step
            if k != self._k:
                self._k = k
                for bn,m in self._saved_mom: bn.momentum = accumulated_momentum(m, k)

    def after_backward(self):
        # the micro-batch is part of the window now, if GradientAccumulation counted it (another callback may have
        # cancelled its backward: then its statistics are not pooled)
        if self._pend:
            if self._ga.window.counted: self._win.extend(self._pend)
            self._pend.clear()

    def _window_closed(self, stepped:bool):
        "GradientAccumulation closed the window: one running-statistics update if it stepped, none if not"
        if self._win and stepped: self._apply()
        self._win.clear()

    @torch.no_grad()
    def _apply(self):
        "One running-statistics update per layer from the window's pooled mean and unbiased variance"
        by_bn = {}
        for bn,n,z in self._win: by_bn.setdefault(bn, []).append((n, z))
        for bn,recs in by_bn.items():
            rm,rv,nbt = bn.running_mean,bn.running_var,bn.num_batches_tracked
            tot = sum(n for n,_ in recs)
            n = torch.tensor([n for n,_ in recs], dtype=torch.float64, device=rm.device)
            st = torch.stack([z for _,z in recs]).double()   # (micro-batches, mean/var, C)
            mean = (n @ st[:,0])/tot
            # Chan et al.: within-micro-batch sums of squares plus the spread of the micro-batch means
            var = ((n-1) @ st[:,1] + n @ (st[:,0]-mean).square_())/(tot-1)
            if nbt is not None: nbt.add_(1)
            m = self._mom[bn]
            f = 1/float(nbt) if m is None else m
            rm.copy_(rm.double().lerp_(mean, f)); rv.copy_(rv.double().lerp_(var, f))
