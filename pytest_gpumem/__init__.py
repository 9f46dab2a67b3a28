"""pytest_gpumem: GPU memory in pytest, through cupy_memstrat's public API.

Installed with cupy-memstrat and enabled through the ``pytest11`` entry point
``gpumem``: per-test peak budgets (``--gpumem-budget``, ``limit_gpu_memory``),
leak checks (``--gpumem-leaks``, ``limit_gpu_leaks``), page-fault budgets
(``--gpumem-faults``, ``limit_page_faults``), the ``gpumem`` and
``gpumem_strategy`` fixtures, a terminal table, JSON and JUnit properties, and
``--gpumem-strategy`` to run a session under a strategy. Nothing is measured
unless asked for. See docs/pytest.md.
"""
