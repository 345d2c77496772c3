"""The accumulation window: how big it is and when it closes (`schedule`, `plan`), its state and verdict
(`state`), one global order of samples over the ranks (`global_window`), its log (`log`), what is said at fit start
(`advice`) and `GradientAccumulation` (`accumulate`), the fastai callback that adapts the loop's events to it.
The names of the 0.2 module `accum_callback.window` (`Window`, `Phase`, ...) are this package's too."""
import importlib as _importlib

def __getattr__(name:str):
    "The names of the 0.2 module of this name, from `state` (loaded on first use: nothing loads at import)"
    if not name.startswith('__'):
        try: return getattr(_importlib.import_module(f'{__name__}.state'), name)
        except AttributeError: pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
