"""Checks that change nothing: `check_accumulation()` (`accumulation`: is the accumulated gradient the large
batch's?), `check_batchnorm()` (`batchnorm`: how stale are the running statistics?) and the sandboxed replay of
micro-batches both use (`replay`). The names of the 0.2 module `accum_callback.check` are this package's too."""
from .. import names_from

__getattr__ = names_from(__name__, 'accumulation')   # (the 0.2 module's names, loaded on first use)
