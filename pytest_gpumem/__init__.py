"""pytest_gpumem: GPU memory in pytest, through cupy_memstrat's public API.

Installed with cupy-memstrat and enabled through the ``pytest11`` entry point
``gpumem``. Today it offers ``--gpumem-strategy`` (run the session under a
cupy_memstrat strategy); per-test budgets, leak checks and page-fault budgets
are being built (see docs/pytest.md).
"""
