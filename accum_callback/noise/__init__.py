"""The gradient noise scale: `GradientNoiseScale` (`scale`: measured from the windows of a fit) and the
measurement outside a fit (`measure`). The names of the 0.2 module `accum_callback.noise` are this package's too."""
from .. import names_from

__getattr__ = names_from(__name__, 'scale')   # (the 0.2 module's names, loaded on first use)
