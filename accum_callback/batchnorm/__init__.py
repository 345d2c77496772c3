"""BatchNorm under accumulation: `BatchNormAccumulation` (`callback`) and its modes (`modes`), the pooled
window statistics ('pool': `pool`), statistics recomputed with the final weights (`precise`) and the norm layers and
conversions (`norm_layers`: GroupNorm, Batch Renorm). The names of the 0.2 module `accum_callback.batchnorm` are this
package's too."""
import importlib as _importlib

def __getattr__(name:str):
    "The names of the 0.2 module of this name, from `callback` (loaded on first use: nothing loads at import)"
    if not name.startswith('__'):
        try: return getattr(_importlib.import_module(f'{__name__}.callback'), name)
        except AttributeError: pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
