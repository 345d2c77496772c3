"""BatchNorm under accumulation: `BatchNormAccumulation` (`callback`) and its modes (`modes`), the pooled
window statistics ('pool': `pool`), statistics recomputed with the final weights (`precise`) and the norm layers and
conversions (`norm_layers`: GroupNorm, Batch Renorm). The names of the 0.2 module `accum_callback.batchnorm` are this
package's too."""
from .. import names_from

__getattr__ = names_from(__name__, 'callback')   # (the 0.2 module's names, loaded on first use)
