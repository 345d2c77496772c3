"""Normalisation layers for accumulation: `BatchRenorm` (1d/2d/3d), the timm norm-act adapters, and the converters that
replace every BatchNorm of a model by GroupNorm or Batch Renorm (in place, keeping the Parameter objects)"""
from __future__ import annotations
import warnings
from numbers import Real

import torch, torch.nn as nn, torch.nn.functional as F

from ..compat.torch import BatchNormBase, foreach, module_dicts
from ..core.args import whole_number
from ..core.protocols import user_stacklevel

__all__ = ['BatchRenorm', 'BatchRenorm1d', 'BatchRenorm2d', 'BatchRenorm3d', 'BatchRenormAct', 'BatchRenormAct2d',
           'ConvertedGroupNormAct', 'bn_to_groupnorm', 'bn_to_batchrenorm', 'is_batchnorm', 'is_converted_norm',
           'set_norm_mode']

def _real(v, name:str, lo:float)->float:
    if isinstance(v, bool) or not isinstance(v, Real): raise TypeError(f"`{name}` must be a number >= {lo}, got {v!r}")
    if not v >= lo: raise ValueError(f"`{name}` must be >= {lo}, got {v}")
    return float(v)

# -- module conversion ------------------------------------------------------------------------------------------------
def _convert(module:nn.Module, fn, name:str='', memo=None)->nn.Module:
    """Replace each `BatchNormBase` below (or at) `module` by `fn(bn, name)`; a layer shared by several parents stays
    shared"""
    memo = {} if memo is None else memo
    if is_batchnorm(module):
        if id(module) not in memo: memo[id(module)] = fn(module, name or '<root>')
        return memo[id(module)]
    for n,child in list(module_dicts(module)[1].items()):   # not `named_children`, which skips a module's second name
        if child is None: continue
        new = _convert(child, fn, f'{name}.{n}' if name else n, memo)
        if new is not child: module.add_module(n, new)
    return module

def set_norm_mode(layer:nn.Module, training:bool)->nn.Module:
    """Put the normalisation of `layer` in training mode (batch statistics) or eval mode (running statistics), and only
    it: `layer.training` is set, its submodules are left as they are. `nn.Module.train()` recurses, and timm's norm-act
    layers (`BatchNormAct2d`) carry their `drop` (a `DropBlock2d` with `drop_block_rate`) and `act` as submodules, which
    must keep the mode the Learner gives the rest of the model. Every mode change the package makes to a norm layer
    ('freeze', `precise`, the check's experiments, the conversions) goes through here. Returns `layer`."""
    layer.training = bool(training)
    return layer

def is_batchnorm(m)->bool:
    """A BatchNorm layer to convert or treat (1d/2d/3d, SyncBatchNorm, timm's norm-act; a `BatchRenorm` is one to
    fastai, not here)"""
    return isinstance(m, BatchNormBase) and not isinstance(m, BatchRenorm)

def is_converted_norm(m)->bool:
    "A GroupNorm made by `bn_to_groupnorm` or a `BatchRenorm`: fastai should treat its parameters as BatchNorm's"
    return getattr(m, '_from_bn', False) or isinstance(m, BatchRenorm)

def _factory(bn)->dict:
    t = next((t for t in (bn.weight, bn.running_mean) if t is not None), None)
    return {} if t is None else dict(device=t.device, dtype=t.dtype)

def _has_stats(bn)->bool:
    "Does `bn` hold running statistics other than the ones it was initialised with?"
    if bn.running_mean is None: return False
    nbt = bn.num_batches_tracked
    return bool((nbt is not None and nbt > 0) or bn.running_mean.ne(0).any() or bn.running_var.ne(1).any())

def _groups(c:int, num_groups:int)->int:
    "The most groups <= `num_groups` that divide `c` channels (1 for a layer of none, as fastai's collab net has)"
    return max((g for g in range(1, min(c, num_groups)+1) if c % g == 0), default=1)

def bn_to_groupnorm(
    module:nn.Module, # a model (or a single BatchNorm layer)
    num_groups:int=32, # most groups per layer: each layer gets the largest count <= this that divides its channels
)->nn.Module:
    """Replace every BatchNorm (1d/2d/3d, SyncBatchNorm) in `module` by `nn.GroupNorm`, in place, and return the root
    (a new module only when `module` itself is a BatchNorm). The GroupNorm reuses the BatchNorm's own `weight` and
    `bias` Parameter objects, so an optimizer, fastai param groups, freeze/unfreeze and discriminative learning rates
    built on the model keep working; device, dtype, `training` and `requires_grad` are kept. Running statistics are
    discarded: one warning when any were not at their initial values.

    GroupNorm accepts `(N,C)` input too (a `BatchNorm1d` head): each group is then normalised over its `C/groups`
    channels of one sample, so a group of one channel gives just the bias (a warning names such `BatchNorm1d` layers).

    >>> from torchvision.models import resnet18
    >>> m = bn_to_groupnorm(resnet18(weights=None))
    >>> type(m.bn1).__name__, m.bn1.num_groups, m.layer4[0].bn2.num_channels
    ('GroupNorm', 32, 512)
    """
    num_groups = whole_number(num_groups, 'num_groups')
    stats,single = [],[]
    def fn(bn, name):
        g = _groups(bn.num_features, num_groups)
        gn = (ConvertedGroupNormAct if _is_norm_act(bn)
              else nn.GroupNorm)(g, bn.num_features, eps=bn.eps, affine=bn.affine, **_factory(bn))
        if bn.affine: gn.weight,gn.bias = bn.weight,bn.bias
        _keep_act(bn, gn)
        gn._from_bn = True   # lets `BatchNormAccumulation` give it fastai's BatchNorm treatment (train_bn, wd_bn_bias)
        if _has_stats(bn): stats.append(name)
        if isinstance(bn, nn.BatchNorm1d) and g == bn.num_features: single.append(name)
        return set_norm_mode(gn, bn.training)   # (its drop and act keep their own mode)
    res = _convert(module, fn)
    if stats: warnings.warn(f"bn_to_groupnorm: running statistics of {len(stats)} BatchNorm layer(s) (e.g. {stats[0]}) "
                            "are discarded: GroupNorm normalises with per-sample statistics only",
                            stacklevel=user_stacklevel())
    if single: warnings.warn(f"bn_to_groupnorm: {single} got one channel per group: on (N,C) input such a GroupNorm "
                             "outputs only its bias; give a smaller `num_groups`", stacklevel=user_stacklevel())
    return res

class BatchRenorm(BatchNormBase):
    """Batch Renormalization (Ioffe, 2017) for (N,C), (N,C,L), (N,C,H,W) or (N,C,D,H,W) input: a `BatchNormBase` with
    BatchNorm's parameters, buffers and state-dict keys. Training normalises with the batch statistics corrected towards
    the running ones, `(x-mean_B)/std_B*r + d`, with `r = std_B/std` clipped to [1/r_max, r_max] and `d =
    (mean_B-mean)/std` clipped to [-d_max, d_max], both without gradient; evaluation is exactly BatchNorm's. `r_max`,
    `d_max` start at 1, 0 (plain BatchNorm) for `warmup` training forwards, then ramp linearly to their values over
    `ramp` forwards. `BatchRenorm1d/2d/3d` are also `nn.BatchNorm1d/2d/3d`, so fastai treats them as BatchNorm
    (`BnFreeze`, `train_bn`, `wd_bn_bias`); the converters pick the one matching the layer they replace."""
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
        num_features = whole_number(num_features, 'num_features', lo=0)   # 0: fastai's collab net has such a BatchNorm
        r_max,d_max = _real(r_max, 'r_max', 1.),_real(d_max, 'd_max', 0.)
        warmup,ramp = whole_number(warmup, 'warmup', lo=0),whole_number(ramp, 'ramp', lo=0)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.r_max,self.d_max,self.warmup,self.ramp = r_max,d_max,warmup,ramp
        self.renorm_steps = 0   # training forwards since creation: drives the ramp (not in the state dict)
        self.fused = True   # compute in the input's precision; False: through a float32 copy (`_renorm`'s reference)

    def _check_input_dim(self, x):
        if x.dim() not in (2,3,4,5):
            raise ValueError(f"BatchRenorm expects (N,C), (N,C,L), (N,C,H,W) or (N,C,D,H,W) input, got {x.dim()}-D")

    def limits(self)->tuple[float,float]:
        "`(r_max, d_max)` in force now"
        t = self.renorm_steps - self.warmup
        f = 0. if t < 0 else (1. if self.ramp == 0 else min(1., t/self.ramp))
        return 1 + (self.r_max-1)*f, self.d_max*f

    def forward(self, x:torch.Tensor)->torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"BatchRenorm({self.num_features}) got {x.shape[1]} channels")
        rm,rv = self.running_mean,self.running_var
        if not (self.training and self.track_running_stats and rm is not None):
            # BatchNorm's own paths: evaluation with running statistics, or batch statistics without them
            use = not self.training or self.track_running_stats
            return F.batch_norm(x, rm if use else None, rv if use else None, self.weight, self.bias,
                                self.training or rm is None, 0., self.eps)
        n = x.numel() // x.shape[1]
        if n < 2:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        r_max,d_max = self.limits()
        self.renorm_steps += 1
        self.num_batches_tracked.add_(1)
        m = 1/float(self.num_batches_tracked) if self.momentum is None else self.momentum
        w,b = (self.weight, self.bias) if self.affine else (None, None)
        return _renorm(x, w, b, rm, rv, self.eps, r_max, d_max, m, fp32=not getattr(self, 'fused', True))

    def extra_repr(self)->str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}, r_max={self.r_max}, d_max={self.d_max}, "
                f"warmup={self.warmup}, ramp={self.ramp}")

def _batch_stats(x)->tuple[torch.Tensor,torch.Tensor]:
    """Per-channel batch mean and biased variance: BatchNorm's own statistics kernel on a CPU or a GPU (Welford, any
    memory format; float32 for a half-precision input on a GPU; 4x faster than `torch.var_mean` on a CPU), else
    `var_mean`"""
    if x.device.type in ('cpu', 'cuda'): return torch.batch_norm_update_stats(x, None, None, 0.)
    var,mean = torch.var_mean(x, dim=[0, *range(2, x.dim())], correction=0)
    return mean,var

def _renorm(x, w, b, rm, rv, eps, r_max, d_max, m, fp32=False):
    """(x-mean_B)/std_B*r + d, then the affine, differentiating through the batch statistics as Batch Renorm does (r and
    d constants to the backward). One reduction for the batch statistics (`_batch_stats`), five `_foreach` ops for r and
    d (clipped) of every channel, then BatchNorm's own kernel (cuDNN on a GPU; it needs a weight and a bias to be
    chosen) with weight w*r and bias w*d + b, which also moves the running statistics as BatchNorm does (unbiased
    variance, momentum `m`). At the warm-up limits (1, 0) it is BatchNorm's call alone. In the input's precision (no
    copy of the activations), or with `fp32` through a float32 copy and back (the reference `tests/test_cuda.py`
    compares the first against)"""
    xf = x.float() if fp32 and x.dtype not in (torch.float32, torch.float64) else x
    if r_max == 1 and d_max == 0: return F.batch_norm(xf, rm, rv, w, b, True, m, eps).to(x.dtype)
    with torch.no_grad():
        mean,var = _batch_stats(xf)
        if var.dtype != rm.dtype: var,mean = var.to(rm.dtype),mean.to(rm.dtype)
        std_b,std = foreach('add')([var, rv], eps)
        foreach('sqrt_')([std_b, std])
        rd = foreach('div')([std_b, mean.sub_(rm)], [std, std])   # r = std_B/std, d = (mean_B-mean)/std
        foreach('clamp_min_')(rd, [1/r_max, -d_max]); foreach('clamp_max_')(rd, [r_max, d_max])
    r,d = rd
    w2,b2 = (r, d) if w is None else (w*r, torch.addcmul(b, w, d))
    return F.batch_norm(xf, rm, rv, w2, b2, True, m, eps).to(x.dtype)

# timm's norm-act layers (`BatchNormAct2d`, a BatchNorm2d subclass used by EfficientNet, RegNet, ...) apply dropout and
# an activation after normalising: a conversion that dropped them would silently change the network.
def _is_norm_act(bn)->bool:
    return isinstance(getattr(bn, 'act', None), nn.Module) and isinstance(getattr(bn, 'drop', None), nn.Module)
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

class ConvertedGroupNormAct(_NormAct, nn.GroupNorm):
    """`nn.GroupNorm` followed by the `drop` and `act` of a converted timm norm-act layer (timm's `GroupNormAct` is
    built otherwise)"""
# (its 0.2 name, which timm's class of another constructor also has: pickles load)
GroupNormAct = ConvertedGroupNormAct
class BatchRenormAct(_NormAct, BatchRenorm):
    "`BatchRenorm` followed by the `drop` and `act` of a converted timm norm-act layer"
class BatchRenormAct2d(_NormAct, BatchRenorm2d):
    "`BatchRenorm2d` followed by the `drop` and `act` of a converted timm norm-act layer"

def _renorm_cls(bn):
    "The BatchRenorm class that replaces `bn`: the same BatchNorm dimension, so fastai's type checks still match"
    act = _is_norm_act(bn)
    if isinstance(bn, nn.BatchNorm2d): return BatchRenormAct2d if act else BatchRenorm2d
    if act: return BatchRenormAct
    if isinstance(bn, nn.BatchNorm1d): return BatchRenorm1d
    if isinstance(bn, nn.BatchNorm3d): return BatchRenorm3d
    return BatchRenorm   # SyncBatchNorm and other BatchNormBase subclasses: any dimension

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
    (True, 'BatchRenorm2d')
    """
    kw = dict(r_max=r_max, d_max=d_max, warmup=warmup, ramp=ramp)
    BatchRenorm(1, **kw)   # validate before touching the model
    def fn(bn, name):
        new = _renorm_cls(bn)(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, **kw,
                              **_factory(bn))
        if bn.affine: new.weight,new.bias = bn.weight,bn.bias
        _keep_act(bn, new)
        new.running_mean,new.running_var,new.num_batches_tracked = bn.running_mean,bn.running_var,bn.num_batches_tracked
        return set_norm_mode(new, bn.training)
    return _convert(module, fn)
