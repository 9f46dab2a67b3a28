"""Only the C extension lives here; everything else is in pyproject.toml.

``cupy_memstrat._hotpath`` (csrc/hotpath.c) is the strategies' allocation hot
path in C. It is optional: where it cannot be compiled (no C compiler or no
Python headers) the install goes on and cupy_memstrat uses the same hot path
in Python (``python -m cupy_memstrat info`` says which one is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cupy_memstrat._hotpath", ["csrc/hotpath.c"], optional=True)])
