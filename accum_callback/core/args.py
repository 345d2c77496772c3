"""The package's argument checks: one rule for every count (`whole_number`) and every switch (`flag`), each naming the
argument and what to give. No torch: the job's command line answers before torch loads."""
from __future__ import annotations
from numbers import Integral

__all__ = ['NotWholeNumber', 'whole_number', 'flag']

class NotWholeNumber(TypeError, ValueError):
    "A count given as something other than a whole number in range (caught as either a `TypeError` or a `ValueError`)"

def whole_number(v, name:str, where:str='', lo:int=1)->int:
    """`v` as an int >= `lo`, or a `NotWholeNumber` error naming `name` (and `where` it was given): the one rule for
    every count"""
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise NotWholeNumber(f"`{name}` must be a whole number >= {lo}{where}, got {v!r} ({type(v).__name__})")
    if v < lo: raise NotWholeNumber(f"`{name}` must be >= {lo}{where}, got {v}")
    return int(v)

def flag(v, name:str)->bool:
    "`v` as True or False, or a `TypeError` naming `name`"
    if not isinstance(v, bool): raise TypeError(f"`{name}` must be True or False, got {v!r}")
    return v
