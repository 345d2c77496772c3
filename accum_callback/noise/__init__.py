"""The gradient noise scale: `GradientNoiseScale` (`scale`: measured from the windows of a fit) and the
measurement outside a fit (`measure`). The names of the 0.2 module `accum_callback.noise` are this package's too."""
import importlib as _importlib

def __getattr__(name:str):
    "The names of the 0.2 module of this name, from `scale` (loaded on first use: nothing loads at import)"
    if not name.startswith('__'):
        try: return getattr(_importlib.import_module(f'{__name__}.scale'), name)
        except AttributeError: pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
