"""The gradient noise scale: `GradientNoiseScale` (`scale`: measured from the windows of a fit) and the
measurement outside a fit (`measure`)."""
