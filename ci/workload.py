"""One program of bench workloads, run once as a script (for python -m cupy_memstrat run --record):

    python -m cupy_memstrat run -s pool --record rec.json ci/workload.py cg-poisson
"""

import sys

import cupy
import cupyx.scipy.sparse as sp

from cupy_memstrat.bench.workloads import WORKLOADS

if len(sys.argv) != 2 or sys.argv[1] not in WORKLOADS:
    sys.exit(f"usage: ci/workload.py NAME; NAME one of {', '.join(WORKLOADS)}")
result = WORKLOADS[sys.argv[1]][0](cupy, sp)
cupy.cuda.Device().synchronize()
del result
