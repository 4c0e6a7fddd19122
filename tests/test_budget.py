"""Budgets: bytes, sizes with units, fractions of the no-recomputation peak; bad input lists the accepted forms."""

from fractions import Fraction

import pytest

from lightning_rotor.budget import BudgetError, format_bytes, parse_budget, resolve_budget


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (8000000, 8000000),
        ("8000000", 8000000),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("100 KB", 100_000),
        ("6gib", 6 * 2**30),
        (2e9, 2 * 10**9),
    ],
)
def test_sizes(spec, expected):
    assert parse_budget(spec) == expected
    assert resolve_budget(spec, 12345) == expected


@pytest.mark.parametrize(
    ("spec", "fraction"),
    [(0.5, Fraction(1, 2)), ("50%", Fraction(1, 2)), ("0.25", Fraction(1, 4)), (1.0, Fraction(1)),
     ("12.5%", Fraction(1, 8))],
)
def test_fractions_resolve_against_reference_peak(spec, fraction):
    assert parse_budget(spec) == fraction
    assert resolve_budget(spec, 1000) == int(fraction * 1000)


@pytest.mark.parametrize("spec", ["lots", "5 parsecs", "GiB", "", "-1GiB", "150%", "0%", 0, -3, True, None, [1],
                                  float("nan"), 2.5])
def test_bad_budgets_list_accepted_forms(spec):
    with pytest.raises(BudgetError) as err:
        parse_budget(spec)
    assert "accepted:" in str(err.value) and "512MiB" in str(err.value) and "50%" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(17) == "17 B"
    assert format_bytes(1437696) == "1.37 MiB"


@pytest.mark.parametrize("spec", [1e19, 1e20, "1e19", "1e400", 2**64, 2**63, "1e999999999", "9" * 60, "-50%", "-0.5",
                                  1.5, "1.5", "2.5e0"])
def test_out_of_range_and_negative_budgets_get_one_line(spec):
    with pytest.raises(BudgetError) as err:
        parse_budget(spec)
    assert "\n" not in str(err.value) and "accepted:" in str(err.value)


@pytest.mark.parametrize(("text", "number"), [("1.5", 1.5), ("5e-1", 0.5), ("0.5", 0.5), ("1.0", 1.0), ("1e3", 1e3),
                                              ("1", 1), ("2", 2)])
def test_a_string_means_what_its_number_means(text, number):
    try:
        expected = parse_budget(number)
    except BudgetError:
        with pytest.raises(BudgetError):
            parse_budget(text)
        return
    assert parse_budget(text) == expected


def test_largest_budget_is_accepted():
    assert parse_budget(2**62) == 2**62
    assert parse_budget(str(2**62)) == 2**62
