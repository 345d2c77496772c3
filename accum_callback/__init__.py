"Exact gradient accumulation for fastai, and the BatchNorm problem accumulation creates, solved"
__version__ = '0.1.0'

import warnings as _warnings
with _warnings.catch_warnings():   # fastai.layers calls the deprecated torch.jit.script at import: not the user's concern
    _warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated', category=FutureWarning)
    import fastai.basics  # noqa: F401

from .schedule import WindowSchedule, as_window_schedule, batch_growth_from_lr
from .accumulate import GradientAccumulation, PARTIAL_MODES
from .batchnorm import (BatchNormAccumulation, BN_MODES, accumulated_momentum, BatchRenorm, bn_to_groupnorm,
                        bn_to_batchrenorm)

__all__ = ['GradientAccumulation', 'PARTIAL_MODES', 'WindowSchedule', 'as_window_schedule', 'batch_growth_from_lr',
           'BatchNormAccumulation', 'BN_MODES', 'accumulated_momentum', 'BatchRenorm', 'bn_to_groupnorm', 'bn_to_batchrenorm']
