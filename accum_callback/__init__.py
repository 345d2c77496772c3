"Exact gradient accumulation for fastai, and the BatchNorm problem accumulation creates, solved"
__version__ = '0.1.0'

from .schedule import WindowSchedule, as_window_schedule, batch_growth_from_lr
from .accumulate import GradientAccumulation, PARTIAL_MODES

__all__ = ['GradientAccumulation', 'PARTIAL_MODES', 'WindowSchedule', 'as_window_schedule', 'batch_growth_from_lr']
