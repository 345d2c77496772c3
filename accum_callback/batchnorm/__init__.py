"""BatchNorm under accumulation: `BatchNormAccumulation` (`callback`) and its modes (`modes`), the pooled
window statistics ('pool': `pool`), statistics recomputed with the final weights (`precise`) and the norm layers and
conversions (`norm_layers`: GroupNorm, Batch Renorm)."""
