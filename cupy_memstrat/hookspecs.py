"""pluggy hook specifications: how strategies (built-in and third-party) register.

A third-party package registers strategies with an entry point in the group
``cupy_memstrat`` that names a module (or object) with a hook implementation::

    # pyproject.toml of the other package
    [project.entry-points.cupy_memstrat]
    mine = "my_package.memstrat_plugin"

    # my_package/memstrat_plugin.py
    import cupy_memstrat

    @cupy_memstrat.hookimpl
    def memstrat_register_strategies(registry):
        registry.add(MyStrategy)   # a cupy_memstrat.Strategy subclass

The built-in strategies register through this same hook and entry-point group.
"""

import pluggy

PROJECT = "cupy_memstrat"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def memstrat_register_strategies(registry):
    """Add strategies to ``registry`` with ``registry.add(StrategyClass)``.

    Args:
        registry (cupy_memstrat.registry.Registry): the process's registry.
    """
