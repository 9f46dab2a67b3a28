import numpy as np
import pytest

from cupy_memstrat import format_size, parse_size
from cupy_memstrat.sizes import format_count


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MiB", 512 * 2**20),
        ("2 GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("10 kB", 10_000),
        ("10KB", 10_000),
        ("3kib", 3072),
        ("1TiB", 2**40),
        ("0B", 0),
        ("1e3", 1000),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


def test_parse_size_int_and_numpy_int():
    assert parse_size(123) == 123
    assert parse_size(np.int64(7)) == 7


def test_percentage_needs_total_and_uses_it():
    assert parse_size("80%", total=1000) == 800
    with pytest.raises(ValueError, match="needs the device's total memory"):
        parse_size("80%")
    with pytest.raises(ValueError, match="between 0% and 100%"):
        parse_size("120%", total=1000)


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "1.2.3GB", "-5MiB", "GiB"])
def test_parse_size_rejects_garbage_naming_the_value(bad):
    with pytest.raises(ValueError) as exc:
        parse_size(bad, what="budget")
    assert "budget" in str(exc.value) and repr(bad) in str(exc.value)


@pytest.mark.parametrize("bad", [1.5, True, None, [1]])
def test_parse_size_rejects_non_integers(bad):
    with pytest.raises(TypeError, match="expected an int number of bytes"):
        parse_size(bad)


def test_parse_size_rejects_negative_int():
    with pytest.raises(ValueError, match=">= 0"):
        parse_size(-1)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (512, "512 B"), (1024, "1.0 KiB"), (812 * 2**20, "812.0 MiB"), (3 * 2**30 // 2, "1.5 GiB")],
)
def test_format_size_iec(n, text):
    assert format_size(n) == text


def test_large_integer_strings_are_exact_and_absurd_sizes_refused():
    assert parse_size("9007199254740993") == 9007199254740993
    assert parse_size("1.GB") == 10**9 and parse_size(".5GB") == 5 * 10**8
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        parse_size("1e300")
    with pytest.raises(ValueError, match="not a finite size"):
        parse_size("1e400GB")
    with pytest.raises(ValueError, match="needs the device's total memory"):
        parse_size("50%", total=-1000)


def test_format_size_needs_an_int():
    with pytest.raises(TypeError):
        format_size("10")


def test_a_negative_string_or_a_huge_int_says_so():
    with pytest.raises(ValueError, match=r"expected a size >= 0 bytes, got '-1'"):
        parse_size("-1")
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        parse_size(2**70)
    assert parse_size(2**64 - 1) == 2**64 - 1  # size_t's largest
    for edge in (2**64, "18446744073709551616"):
        with pytest.raises(ValueError, match="does not fit in 64 bits"):
            parse_size(edge)


@pytest.mark.parametrize("total", ["100", 1.5, float("nan"), True])
def test_a_percentages_total_must_be_an_int(total):
    with pytest.raises(TypeError, match="total: expected an int number of bytes or None"):
        parse_size("50%", total=total)


def test_format_size_refuses_a_bool():
    with pytest.raises(TypeError, match="got bool True"):
        format_size(True)


def test_a_numpy_array_or_a_float_is_named_as_a_bad_size():
    with pytest.raises(TypeError, match=r"budget: expected an int number of bytes or a size string .* got ndarray"):
        parse_size(np.array([1, 2]), what="budget")
    with pytest.raises(TypeError, match="nbytes: expected an int number of bytes, got float 1.5"):
        format_size(1.5)
    with pytest.raises(TypeError, match="nbytes: expected an int number of bytes, got NoneType None"):
        format_size(None)


@pytest.mark.parametrize("n, text", [(0, "0 allocations"), (1, "1 allocation"), (2, "2 allocations")])
def test_format_count_plural_unless_one(n, text):
    assert format_count(n, "allocation") == text


@pytest.mark.parametrize("n, noun", [(True, "x"), (1.0, "x"), ("1", "x"), (None, "x"), (3, None)])
def test_format_count_refuses_what_is_no_count_or_noun(n, noun):
    with pytest.raises(TypeError, match="expected an int count|expected a str"):
        format_count(n, noun)
