"Exact gradient accumulation for fastai, and the BatchNorm problem accumulation creates, solved"
__version__ = '0.2.0'   # the one place: setup.cfg reads it; CHANGELOG.md says what changed

import importlib as _importlib, sys as _sys

# What users call: name -> module. Loaded on first use (PEP 562), so that `python -m accum_callback --help` answers
# before torch and fastai load; where fastai is loaded already (a notebook), everything loads now and `Learner.accumulate`
# is there at once. Everything else is imported from its module (`accum_callback.batchnorm.pool.PooledStats`).
_API = dict(
    GradientAccumulation='window.accumulate', MicroBatching='micro', BatchNormAccumulation='batchnorm.callback',
    GradientNoiseScale='noise.scale', check_accumulation='check.accumulation', AccumulationReport='check.accumulation',
    WindowSchedule='window.schedule', batch_growth_from_lr='window.schedule', bn_to_groupnorm='batchnorm.norm_layers',
    bn_to_batchrenorm='batchnorm.norm_layers', update_bn_stats='batchnorm.precise', Checkpoint='resume.checkpoint')
__all__ = list(_API)
# 0.2.0's other top-level names: still importable from the package, with a FutureWarning naming their module (CHANGELOG)
_MOVED = dict(
    Window='window.state', PARTIAL_MODES='window.accumulate', is_out_of_memory='micro', stateful_modules='micro',
    CHECK_CAUSES='check.accumulation', loss_items='core.losses', loss_reduction='core.losses', default_blocks='fsdp',
    fsdp_full_state_dict='fsdp', as_window_schedule='window.schedule', MODES='batchnorm.callback',
    accumulated_momentum='batchnorm.callback', pooled_mean_var='batchnorm.callback', PooledStats='batchnorm.pool',
    BN_MODES='batchnorm.modes', BatchRenorm='batchnorm.norm_layers', BatchRenorm1d='batchnorm.norm_layers',
    BatchRenorm2d='batchnorm.norm_layers', BatchRenorm3d='batchnorm.norm_layers', NoiseScaleSchedule='noise.scale',
    NoiseScaleReport='noise.measure', noise_estimates='noise.scale', precise_bn_stats='batchnorm.precise',
    PopulationStats='batchnorm.precise', BatchNormReport='check.batchnorm')
# The package in tiers, bottom up: each subpackage (or module) imports only its own tier and those below it, and
# within a tier each module only those before it (tests/test_package.py). `check` and `fsdp` add methods to fastai's
# `Learner` (`check_accumulation`, `to_fsdp`, FSDP2-aware `save`/`load`/`export`): the package loads them all together,
# so that whichever name is used first, the Learner has them all.
_TIERS = (('compat', ('torch', 'fastai')),
          ('core', ('args', 'files', 'losses', 'distributed', 'loaders', 'protocols')),
          ('micro', ('pieces', 'state', 'retry', 'inference', 'loader', 'callback')),
          ('window', ('schedule', 'global_window', 'state', 'log', 'plan', 'advice', 'accumulate')),
          ('batchnorm', ('modes', 'norm_layers', 'precise', 'pool', 'callback')),
          ('check', ('replay', 'batchnorm', 'accumulation')),
          ('noise', ('scale', 'measure')),
          ('resume', ('format', 'fit_state', 'fit_place', 'world_size', 'sharded', 'checkpoint')),
          ('fsdp', ()), ('testing', ()))
_LAYERS = tuple(f'{t}.{m}' if ms else t for t,ms in _TIERS for m in (ms or ('',)))
# 0.2's module paths, where a module moved into a subpackage (0.3): `import accum_callback.precise` still imports it
# (the same module object, so a pickle naming the old path loads); docs/versions.md lists them
_OLD_PATHS = dict(
    fastai_compat='compat.fastai', validate='core.args', files='core.files', losses='core.losses',
    distributed='core.distributed', loaders='core.loaders', guard='core.protocols', schedule='window.schedule',
    plan='window.plan', window_log='window.log', global_order='window.global_window', advice='window.advice',
    accumulate='window.accumulate', modes='batchnorm.modes', norm_layers='batchnorm.norm_layers',
    precise='batchnorm.precise', bn_stats='batchnorm.pool', replay='check.replay', bn_check='check.batchnorm',
    noise_measure='noise.measure', checkpoint_format='resume.format', fit_state='resume.fit_state',
    fit_place='resume.fit_place', elastic='resume.world_size', sharded_checkpoint='resume.sharded',
    checkpoint='resume.checkpoint')

class _OldPaths:
    "Imports a 0.2 module path as the module now at its new path (an importlib meta path finder and loader: PEP 451)"
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        head,_,rest = name.partition('.')
        if head == __name__ and rest in _OLD_PATHS:
            import importlib.util
            return importlib.util.spec_from_loader(name, cls())
        return None
    def create_module(self, spec):
        self.module = _importlib.import_module(f'{__name__}.{_OLD_PATHS[spec.name.partition(".")[2]]}')
        self.spec = self.module.__spec__
        return self.module
    def exec_module(self, module): module.__spec__ = self.spec   # (the import system set the old path's: put back)

_sys.meta_path[:] = [f for f in _sys.meta_path if getattr(f, '__qualname__', None) != '_OldPaths'] + [_OldPaths]   # (once, a reload too)

def names_from(package:str, module:str):
    """A subpackage's `__getattr__` that hands out the names of its module `module` (loaded on first use: nothing loads
    when the subpackage is imported): `window`, `batchnorm`, `check`, `noise` and `compat` were 0.2 modules, and hand
    out those modules' names this way"""
    def __getattr__(name:str):
        if not name.startswith('__'):
            try: return getattr(_importlib.import_module(f'{package}.{module}'), name)
            except AttributeError: pass
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__

def _load_all():
    import warnings
    with warnings.catch_warnings():   # fastai.layers calls the deprecated torch.jit.script at import: not the user's concern
        warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated', category=FutureWarning)
        for m in _LAYERS: _importlib.import_module(f'{__name__}.{m}')
    for n in __all__: globals()[n] = getattr(_sys.modules[f'{__name__}.{_API[n]}'], n)

def __getattr__(name:str):
    if name in _MOVED:
        import warnings
        warnings.warn(f"`accum_callback.{name}` is no longer at the package's top level (0.3.0): import it from "
                      f"`accum_callback.{_MOVED[name]}`", FutureWarning, stacklevel=2)
        if _MOVED[name] != 'batchnorm.modes': _load_all()   # (the BatchNorm modes need no torch)
        return getattr(_importlib.import_module(f'{__name__}.{_MOVED[name]}'), name)
    if name not in _API: raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_all()
    return globals()[name]

def __dir__(): return sorted(list(globals()) + __all__)

if 'fastai.learner' in _sys.modules: _load_all()
