"""kt_kernel: CPU kernels for the routed experts of Mixture-of-Experts layers.

One wheel holds three builds of the same kernels (AMX, AVX512, AVX2); importing the package binds
the best one this CPU can run. ``KT_KERNEL_CPU_VARIANT`` forces a build, ``KT_KERNEL_DEBUG=1``
explains the choice, ``python -m kt_kernel info`` prints it.
"""

from importlib.metadata import PackageNotFoundError, version

from . import quant as quant  # kt_kernel.quant after a bare `import kt_kernel`
from ._native import build as _build
from .experts import KTMoEWrapper
from .info import cpu_info
from .placement import generate_gpu_experts_masks

try:
    __version__: str = version("kt-kernel")
except PackageNotFoundError:  # running from a source tree without installed metadata
    __version__ = "0+unknown"

#: The build bound at import: "amx", "avx512" or "avx2".
__cpu_variant__: str = _build.variant

__all__ = ["KTMoEWrapper", "cpu_info", "generate_gpu_experts_masks", "__cpu_variant__", "__version__"]
