"""The names of the BatchNorm modes, in one place: `BatchNormAccumulation`, the job, the study, the bench and the tests
all take them from here. A module of its own with no imports, so that the command line can offer them before torch loads."""
__all__ = ['BN_MODES']

BN_MODES = ('pool', 'momentum', 'freeze', 'groupnorm', 'renorm', 'window', 'window-approx')   # `accum_callback.batchnorm.MODES` maps each to its class
