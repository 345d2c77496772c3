"""Checks that change nothing: `check_accumulation()` (`accumulation`: is the accumulated gradient the large
batch's?), `check_batchnorm()` (`batchnorm`: how stale are the running statistics?) and the sandboxed replay of
micro-batches both use (`replay`). The names of the 0.2 module `accum_callback.check` are this package's too."""
import importlib as _importlib

def __getattr__(name:str):
    "The names of the 0.2 module of this name, from `accumulation` (loaded on first use: nothing loads at import)"
    if not name.startswith('__'):
        try: return getattr(_importlib.import_module(f'{__name__}.accumulation'), name)
        except AttributeError: pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
