"""The BatchNorm modes in one place: their names (`BN_MODES`) and the options objects of the modes that take options
(`Freeze`, `Groups`, `Renorm`: `BatchNormAccumulation(Renorm(ramp=1000))`). `BatchNormAccumulation`, the job, the study,
the bench and the tests all take them from here. The standard library only, so that the command line can offer the
modes before torch loads."""
from __future__ import annotations
from dataclasses import dataclass
from numbers import Integral, Real
from typing import ClassVar

__all__ = ['BN_MODES', 'BN_OPTIONS', 'Freeze', 'Groups', 'Renorm']

# `accum_callback.batchnorm.MODES` maps each to its class
BN_MODES = ('pool', 'momentum', 'freeze', 'groupnorm', 'renorm', 'window', 'window-approx')

def _refuse(ok:bool, owner:str, field:str, v, want:str, fix:str):
    if not ok: raise ValueError(f"`{owner}.{field}` must be {want}, got {v!r}: {fix}")

def _count(owner:str, field:str, v, lo:int, fix:str):
    ok = isinstance(v, Integral) and not isinstance(v, bool) and v >= lo
    _refuse(ok, owner, field, v, f'a whole number >= {lo}', fix)

def _number(owner:str, field:str, v, lo:float, fix:str):
    _refuse(isinstance(v, Real) and not isinstance(v, bool) and v >= lo, owner, field, v, f'a number >= {lo:g}', fix)

@dataclass(frozen=True)
class Freeze:
    """The 'freeze' mode's options: BatchNorm layers normalise with their running statistics in training too.
    `BatchNormAccumulation(Freeze())` is `BatchNormAccumulation('freeze')`.

    >>> Freeze(train_affine=False)
    Freeze(train_affine=False)
    >>> Freeze().name
    'freeze'
    """
    name: ClassVar[str] = 'freeze'
    train_affine:bool=True # keep training the BatchNorm weight and bias (False freezes them too)
    def __post_init__(self):
        _refuse(isinstance(self.train_affine, bool), 'Freeze', 'train_affine', self.train_affine, 'True or False',
                'True trains the BatchNorm weight and bias, False freezes them too')

@dataclass(frozen=True)
class Groups:
    """The 'groupnorm' mode's options: BatchNorm layers become `torch.nn.GroupNorm` at the start of fit
    (`bn_to_groupnorm`). `BatchNormAccumulation(Groups())` is `BatchNormAccumulation('groupnorm')`. (Named `Groups`, not
    `GroupNorm`: this is a mode's options, not a layer, and a `GroupNorm` here would shadow torch's layer in code
    importing both.)

    >>> Groups(num_groups=16)
    Groups(num_groups=16)
    >>> Groups().name
    'groupnorm'
    """
    name: ClassVar[str] = 'groupnorm'
    num_groups:int=32 # most groups per layer: each layer gets the largest count <= this that divides its channels
    def __post_init__(self):
        _count('Groups', 'num_groups', self.num_groups, 1, 'the most groups per layer, e.g. 32')

@dataclass(frozen=True)
class Renorm:
    """The 'renorm' mode's options: BatchNorm layers become `BatchRenorm` at the start of fit (`bn_to_batchrenorm`).
    `BatchNormAccumulation(Renorm())` is `BatchNormAccumulation('renorm')`.

    >>> Renorm(ramp=1000)
    Renorm(r_max=3.0, d_max=5.0, warmup=0, ramp=1000)
    >>> Renorm().name
    'renorm'
    """
    name: ClassVar[str] = 'renorm'
    r_max:float=3. # largest std correction once ramped (>= 1)
    d_max:float=5. # largest mean correction, in running stds, once ramped (>= 0)
    warmup:int=0 # training forwards as plain BatchNorm first
    ramp:int=5000 # training forwards over which the limits then grow from 1, 0 to `r_max`, `d_max`
    def __post_init__(self):
        _number('Renorm', 'r_max', self.r_max, 1, 'the largest std correction; 1 turns it off')
        _number('Renorm', 'd_max', self.d_max, 0, 'the largest mean correction, in running stds; 0 turns it off')
        _count('Renorm', 'warmup', self.warmup, 0, 'training forwards as plain BatchNorm first, e.g. 0')
        _count('Renorm', 'ramp', self.ramp, 0, 'training forwards over which the limits grow, e.g. 5000')

BN_OPTIONS = {c.name: c for c in (Freeze, Groups, Renorm)}   # the modes that take options, each with its options' class
