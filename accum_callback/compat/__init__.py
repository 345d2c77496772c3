"""torch's and fastai's names outside their public APIs, fenced in two modules: `compat.torch` (private torch
attributes, version differences, FSDP2's internals) and `compat.fastai` (fastai's private loop names and loader
internals). Nothing else in the package reaches either library's private names (tests/test_package.py)."""
import importlib as _importlib

def __getattr__(name:str):
    "The names of the 0.2 module of this name, from `torch` (loaded on first use: nothing loads at import)"
    if not name.startswith('__'):
        try: return getattr(_importlib.import_module(f'{__name__}.torch'), name)
        except AttributeError: pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
