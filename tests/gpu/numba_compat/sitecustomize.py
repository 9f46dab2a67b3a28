"""Put on PYTHONPATH by the GPU tests' child processes that compile Numba kernels.

numba-cuda 0.30.4 registers an overload of ``numpy.row_stack`` when it compiles its first
kernel; NumPy 2.5 removed ``row_stack`` (an alias of ``vstack`` since NumPy 2.0), so on the
H200 image (numba-cuda 0.30.4, NumPy 2.5.2) every kernel launch failed with
"module 'numpy' has no attribute 'row_stack'". The alias is put back for those processes only.
"""

import numpy as _np

if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack
