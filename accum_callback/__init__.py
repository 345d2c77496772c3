"Exact gradient accumulation for fastai, and the BatchNorm problem accumulation creates, solved"
__version__ = '0.2.0'   # the one place: setup.cfg reads it; CHANGELOG.md says what changed

import importlib as _importlib, sys as _sys

# What users call: name -> submodule. Loaded on first use (PEP 562), so that `python -m accum_callback --help` answers
# before torch and fastai load; where fastai is loaded already (a notebook), everything loads now and `Learner.accumulate`
# is there at once. Everything else is imported from its module (`accum_callback.batchnorm.PooledStats`).
_API = dict(
    GradientAccumulation='accumulate', MicroBatching='micro', BatchNormAccumulation='batchnorm', GradientNoiseScale='noise',
    check_accumulation='check', AccumulationReport='check', WindowSchedule='schedule', batch_growth_from_lr='schedule',
    bn_to_groupnorm='norm_layers', bn_to_batchrenorm='norm_layers', update_bn_stats='precise', Checkpoint='checkpoint')
__all__ = list(_API)
# 0.2.0's other top-level names: still importable from the package, with a FutureWarning naming their module (CHANGELOG)
_MOVED = dict(
    Window='window', PARTIAL_MODES='accumulate', is_out_of_memory='micro', stateful_modules='micro', CHECK_CAUSES='check',
    loss_items='losses', loss_reduction='losses', default_blocks='fsdp', fsdp_full_state_dict='fsdp',
    as_window_schedule='schedule', MODES='batchnorm', accumulated_momentum='batchnorm', pooled_mean_var='batchnorm',
    PooledStats='batchnorm', BN_MODES='modes', BatchRenorm='norm_layers', BatchRenorm1d='norm_layers',
    BatchRenorm2d='norm_layers', BatchRenorm3d='norm_layers', NoiseScaleSchedule='noise', NoiseScaleReport='noise_measure',
    noise_estimates='noise', precise_bn_stats='precise', PopulationStats='precise', BatchNormReport='bn_check')
# The submodules, each importing only those before it. `check` and `fsdp` add methods to fastai's `Learner`
# (`check_accumulation`, `to_fsdp`, FSDP2-aware `save`/`load`/`export`): the package loads them all together, so that
# whichever name is used first, the Learner has them all.
_LAYERS = ('modes', 'validate', 'compat', 'fastai_compat', 'files', 'schedule', 'losses', 'norm_layers', 'distributed', 'global_order', 'window', 'window_log', 'checkpoint_format', 'guard', 'loaders', 'micro', 'plan', 'precise', 'bn_stats', 'replay',
           'bn_check', 'advice', 'accumulate', 'batchnorm', 'check', 'fsdp', 'noise', 'noise_measure', 'fit_state', 'fit_place', 'elastic', 'sharded_checkpoint', 'checkpoint', 'testing')

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
        if _MOVED[name] != 'modes': _load_all()   # (the BatchNorm modes need no torch)
        return getattr(_importlib.import_module(f'{__name__}.{_MOVED[name]}'), name)
    if name not in _API: raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_all()
    return globals()[name]

def __dir__(): return sorted(list(globals()) + __all__)

if 'fastai.learner' in _sys.modules: _load_all()
