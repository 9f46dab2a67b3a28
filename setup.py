"""Only the C extension lives here; everything else is in pyproject.toml.

``cupy_memstrat._hotpath`` (csrc/hotpath.c, one compilation unit over the files
of csrc/hotpath/, one per concern) is the strategies' allocation hot path in C.
It is optional: where it cannot be compiled (no C compiler or no Python headers)
the install goes on and cupy_memstrat uses the reference model of the same hot
path in Python, slower (``python -m cupy_memstrat info`` says which one is in use).
``CUPY_MEMSTRAT_REQUIRE_HOTPATH=1`` makes a failed compile an error: a wheel
built for others (cibuildwheel, pyproject.toml) always carries the C path.
"""

import glob
import os

from setuptools import Extension, setup

required = os.environ.get("CUPY_MEMSTRAT_REQUIRE_HOTPATH", "").strip().lower() in ("1", "true", "yes", "on")
parts = sorted(glob.glob("csrc/hotpath/*"))  # included by csrc/hotpath.c: rebuilt when one changes
setup(ext_modules=[Extension("cupy_memstrat._hotpath", ["csrc/hotpath.c"], depends=parts, optional=not required)])
