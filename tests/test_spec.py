import pytest

import cupy_memstrat
from cupy_memstrat.options import parse_spec


def test_spec_and_keywords_mean_the_same(fake):
    a = cupy_memstrat.create("device:track_origins=true", backend=fake)
    b = cupy_memstrat.create("device", track_origins=True, backend=fake)
    assert a.config == b.config == {"track_origins": True, "oom_snapshot": None, "granule": 1}


def test_parse_spec_splits_options():
    assert parse_spec("async:release_threshold=4GiB, max_size=8GiB") == (
        "async",
        {"release_threshold": "4GiB", "max_size": "8GiB"},
    )
    assert parse_spec("device") == ("device", {})
    assert parse_spec("device:") == ("device", {})


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "with a name"),
        (":a=1", "with a name"),
        ("device:track_origins", "expected KEY=VALUE"),
        ("device:=1", "expected KEY=VALUE"),
        ("device:a=1,a=2", "given twice"),
    ],
)
def test_bad_specs_name_the_spec(spec, message):
    with pytest.raises(ValueError, match=message) as exc:
        parse_spec(spec)
    assert repr(spec) in str(exc.value)


def test_spec_must_be_a_string():
    with pytest.raises(TypeError, match="expected a name"):
        cupy_memstrat.create(42)


def test_unknown_option_lists_valid_ones(fake):
    with pytest.raises(ValueError,
                       match=r"unknown option 'colour'; valid options: granule, oom_snapshot, track_origins"):
        cupy_memstrat.create("device:colour=blue", backend=fake)


def test_bad_option_value_names_option_and_value(fake):
    with pytest.raises(ValueError, match=r"option track_origins: expected true or false, "
                                         r"or a number of frames from 1 to 128, got 'sometimes'"):
        cupy_memstrat.create("device", track_origins="sometimes", backend=fake)


def test_option_in_spec_and_keyword_is_an_error(fake):
    with pytest.raises(ValueError, match="given both in the spec and as a keyword"):
        cupy_memstrat.create("device:track_origins=1", track_origins=False, backend=fake)


def test_validate_needs_no_gpu():
    assert cupy_memstrat.validate("malloc:track_origins=on") == (
        "device", {"track_origins": True, "oom_snapshot": None, "granule": 1})


def test_bool_options_take_0_and_1(fake):
    assert cupy_memstrat.create("device", track_origins=1, backend=fake).config["track_origins"] is True


def test_a_huge_spec_gets_a_short_error():
    with pytest.raises(ValueError) as exc:
        cupy_memstrat.validate("device:" + "x" * 100_000)
    assert len(str(exc.value)) < 200


def test_track_origins_takes_frames_and_refuses_what_is_not_a_count(fake):
    import numpy as np

    for given, got in ((True, True), (1, True), ("1", True), (" 8 ", 8), ("08", 8), (np.int64(8), 8),
                       (np.True_, True), (np.False_, False), ("no", False), (128, 128)):
        assert cupy_memstrat.create("device", backend=fake, track_origins=given).config["track_origins"] == got
    for bad in (0, "0", -1, 129, 10**9, 1.5, None, "9" * 5000, "eight"):
        with pytest.raises(ValueError, match="option track_origins: expected true or false, or a number of frames "
                                             "from 1 to 128"):
            cupy_memstrat.create("device", backend=fake, track_origins=bad)


def test_a_misspelt_option_in_a_spec_gets_a_did_you_mean():
    with pytest.raises(ValueError, match=r"strategy 'managed': unknown option 'prefetc' \(did you mean 'prefetch'\?\); "
                                         r"valid options: .*prefetch"):
        cupy_memstrat.validate("managed:prefetc=on_new")
    with pytest.raises(ValueError, match=r"unknown option 'zzz'; valid options"):  # nothing close: no guess
        cupy_memstrat.validate("async:zzz=1")
