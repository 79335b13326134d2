"""Triton GPU kernels for the Pagoda engine.

The kernels themselves arrive with the kernels issue; until then this package only carries its version.
"""

__version__ = "0.1.0"
