"""Triton kernels for the Pagoda engine, each next to a plain-torch reference of the same signature.

Kernel modules import Triton; import them (``from pagoda_kernels.decode_attention import ...``)
only where a Triton path is wanted. On a machine without a GPU, set ``TRITON_INTERPRET=1`` *before*
importing a kernel module to run it on CPU tensors in Triton's interpreter (for tests; slow).
"""

__version__ = "0.1.0"
