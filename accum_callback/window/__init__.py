"""The accumulation window: how big it is and when it closes (`schedule`, `plan`), its state and verdict
(`state`), one global order of samples over the ranks (`global_window`), its log (`log`), what is said at fit start
(`advice`) and `GradientAccumulation` (`accumulate`), the fastai callback that adapts the loop's events to it.
The names of the 0.2 module `accum_callback.window` (`Window`, `Phase`, ...) are this package's too."""
from .. import names_from

__getattr__ = names_from(__name__, 'state')   # (the 0.2 module's names, loaded on first use)
