import importlib.metadata
import sys
import textwrap

import pytest

import cupy_memstrat
from cupy_memstrat import registry as reg


@pytest.fixture
def fresh_registry():
    reg._reset()
    yield
    reg._reset()


def test_builtins_are_registered_through_the_hook():
    pm = reg.plugin_manager()
    assert pm.get_plugin("builtin") is not None
    names = [impl.plugin_name for impl in pm.hook.memstrat_register_strategies.get_hookimpls()]
    assert "builtin" in names
    assert "device" in cupy_memstrat.available()


def test_builtin_entry_point_is_declared_in_the_installed_metadata():
    eps = importlib.metadata.entry_points(group="cupy_memstrat")
    if not any(ep.name == "builtin" for ep in eps):
        pytest.skip("cupy-memstrat is not installed (running from a source tree)")
    assert any(ep.value == "cupy_memstrat.strategies" for ep in eps if ep.name == "builtin")


def test_available_gives_one_line_descriptions():
    for name, desc in cupy_memstrat.available().items():
        assert desc and "\n" not in desc, name


def test_alias_resolves_to_the_same_strategy(fake):
    assert type(cupy_memstrat.create("malloc", backend=fake)) is cupy_memstrat.DeviceStrategy


def test_unknown_name_lists_available_ones():
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'; available: .*device \(alias malloc\)"):
        cupy_memstrat.create("nope")


def _install_fake_distribution(tmp_path, plugin_source: str, name="thirdparty"):
    (tmp_path / f"{name}_memstrat.py").write_text(textwrap.dedent(plugin_source))
    info = tmp_path / f"{name}_memstrat-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-memstrat\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[cupy_memstrat]\n{name} = {name}_memstrat\n")
    sys.path.insert(0, str(tmp_path))


PLUGIN = """
    import cupy_memstrat
    from cupy_memstrat.options import Option, as_int

    class CountingStrategy(cupy_memstrat.DeviceStrategy):
        name = "counting"
        description = "a third-party strategy"
        aliases = ()
        options = (Option("tag", as_int, 0, "a number"),)

    @cupy_memstrat.hookimpl
    def memstrat_register_strategies(registry):
        registry.add(CountingStrategy)
"""


def test_third_party_entry_point_registers_a_strategy(tmp_path, fresh_registry, fake):
    _install_fake_distribution(tmp_path, PLUGIN)
    try:
        assert cupy_memstrat.available()["counting"] == "a third-party strategy"
        s = cupy_memstrat.create("counting:tag=7", backend=fake)
        assert s.config == {"track_origins": False, "oom_snapshot": None, "tag": 7}
        ptr = s.raw_malloc(1024, 0)
        assert s.stats(0).bytes_in_use == 1024
        s.raw_free(ptr, 0)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("thirdparty_memstrat", None)


def test_a_taken_name_is_refused_naming_both(tmp_path, fresh_registry):
    _install_fake_distribution(
        tmp_path,
        """
        import cupy_memstrat

        class Impostor(cupy_memstrat.DeviceStrategy):
            name = "device"

        @cupy_memstrat.hookimpl
        def memstrat_register_strategies(registry):
            registry.add(Impostor)
        """,
        name="impostor",
    )
    try:
        with pytest.raises(ValueError, match=r"strategy name 'device' of .* is already taken by") as exc:
            cupy_memstrat.available()
        assert "impostor_memstrat.Impostor" in str(exc.value)
        assert "cupy_memstrat.strategies.device.DeviceStrategy" in str(exc.value)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("impostor_memstrat", None)


def test_registry_add_rejects_non_strategies():
    with pytest.raises(TypeError, match="expected a cupy_memstrat.Strategy subclass"):
        reg.Registry().add(object)


@pytest.mark.parametrize("name, aliases", [("has space", ()), ("a:b", ()), ("ok", "fast2")])
def test_registry_add_rejects_unreachable_names(name, aliases):
    cls = type("S", (cupy_memstrat.DeviceStrategy,), {"name": name, "aliases": aliases})
    with pytest.raises((ValueError, TypeError), match="registry.add"):
        reg.Registry().add(cls)


def test_the_documented_third_party_example_works(fake, capsys):
    """docs/strategies.md's example: a Strategy subclass with method hooks and an option."""
    from cupy_memstrat.options import Option, as_size

    class Chatty(cupy_memstrat.Strategy):
        name = "chatty"
        description = "cudaMalloc, printing every request over a threshold"
        options = (Option("threshold", as_size, 1 << 30, "print requests of at least this many bytes"),)

        def allocate(self, size):
            if size >= self.config["threshold"]:
                print(f"chatty: {size} bytes")
            return self.backend.malloc(size)

        def deallocate(self, ptr):
            self.backend.free(ptr)

    r = reg.Registry()
    r.add(Chatty)
    s = r.get("chatty")(threshold="1KiB", backend=fake)
    p = s.raw_malloc(4096)
    assert capsys.readouterr().out == "chatty: 4096 bytes\n"
    s.raw_free(p)
    assert fake.used_bytes(0) == 0 and s.stats().n_frees == 1


def test_a_device_subclass_keeps_its_own_hooks(fake):
    calls = []

    class Logged(cupy_memstrat.DeviceStrategy):
        name = "logged"
        aliases = ()

        def allocate(self, size):
            calls.append(size)
            return self.backend.malloc(size)

    s = Logged(backend=fake)
    s.raw_free(s.raw_malloc(100))
    assert calls == [100] and fake.used_bytes(0) == 0


def test_a_near_miss_gets_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown strategy 'DEVICE' \(did you mean 'device'\?\); available"):
        cupy_memstrat.validate("DEVICE")
