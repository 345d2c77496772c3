"Exact gradient accumulation for fastai, and the BatchNorm problem accumulation creates, solved"
__version__ = '0.3.0'   # the one place: setup.cfg reads it; CHANGELOG.md says what changed

import importlib as _importlib, sys as _sys

# What users call: name -> module. Loaded on first use (PEP 562), so that `python -m accum_callback --help` answers
# before torch and fastai load; where fastai is loaded already (a notebook), everything loads now and
# `Learner.accumulate`
# is there at once. Everything else is imported from its module (`accum_callback.batchnorm.pool.PooledStats`).
_API = dict(
    GradientAccumulation='window.accumulate', MicroBatching='micro', BatchNormAccumulation='batchnorm.callback',
    GradientNoiseScale='noise.scale', check_accumulation='check.accumulation', AccumulationReport='check.accumulation',
    WindowSchedule='window.schedule', batch_growth_from_lr='window.schedule', bn_to_groupnorm='batchnorm.norm_layers',
    bn_to_batchrenorm='batchnorm.norm_layers', update_bn_stats='batchnorm.precise', Checkpoint='resume.checkpoint',
    # (`BatchNormAccumulation`'s modes' options)
    Freeze='batchnorm.modes', Groups='batchnorm.modes', Renorm='batchnorm.modes')
__all__ = list(_API)
# The package in tiers, bottom up: each subpackage (or module) imports only its own tier and those below it, and
# within a tier each module only those before it (tests/test_package.py). `check` and `fsdp` add methods to fastai's
# `Learner` (`check_accumulation`, `to_fsdp`, FSDP2-aware `save`/`load`/`export`): the package loads them all together,
# so that whichever name is used first, the Learner has them all.
_TIERS = (('compat', ('torch', 'fastai')),
          ('core', ('args', 'files', 'losses', 'distributed', 'loaders', 'batches', 'protocols')),
          ('micro', ('pieces', 'state', 'retry', 'inference', 'loader', 'callback')),
          ('window', ('schedule', 'global_window', 'state', 'log', 'plan', 'advice', 'lr_find', 'accumulate')),
          ('batchnorm', ('modes', 'norm_layers', 'precise', 'window_stats', 'pool', 'callback')),
          ('check', ('replay', 'batchnorm', 'accumulation')),
          ('noise', ('scale', 'measure')),
          ('resume', ('format', 'fit_state', 'fit_place', 'world_size', 'sharded', 'cadence', 'checkpoint')),
          ('fsdp', ()), ('testing', ()))
_LAYERS = tuple(f'{t}.{m}' if ms else t for t,ms in _TIERS for m in (ms or ('',)))
def _load_all():
    import warnings
    # fastai.layers calls the deprecated torch.jit.script at import: not the user's concern
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated', category=FutureWarning)
        for m in _LAYERS: _importlib.import_module(f'{__name__}.{m}')
    for n in __all__: globals()[n] = getattr(_sys.modules[f'{__name__}.{_API[n]}'], n)

def __getattr__(name:str):
    if name not in _API: raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_all()
    return globals()[name]

def __dir__(): return sorted(list(globals()) + __all__)

if 'fastai.learner' in _sys.modules: _load_all()
