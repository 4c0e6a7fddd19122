"""Budgets: bytes, sizes with units, fractions of the no-recomputation peak; bad input lists the accepted forms."""

from fractions import Fraction

import pytest

from lightning_rotor.budget import (
    BudgetError,
    format_bandwidth,
    format_bytes,
    parse_bandwidth,
    parse_budget,
    resolve_budget,
)


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
    [
        (0.5, Fraction(1, 2)),
        ("50%", Fraction(1, 2)),
        ("0.25", Fraction(1, 4)),
        (1.0, Fraction(1)),
        ("12.5%", Fraction(1, 8)),
    ],
)
def test_fractions_resolve_against_reference_peak(spec, fraction):
    assert parse_budget(spec) == fraction
    assert resolve_budget(spec, 1000) == int(fraction * 1000)


@pytest.mark.parametrize(
    "spec", ["lots", "5 parsecs", "GiB", "", "-1GiB", "150%", "0%", 0, -3, True, None, [1], float("nan"), 2.5]
)
def test_bad_budgets_list_accepted_forms(spec):
    with pytest.raises(BudgetError) as err:
        parse_budget(spec)
    assert "accepted:" in str(err.value) and "512MiB" in str(err.value) and "50%" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(17) == "17 B"
    assert format_bytes(1437696) == "1.37 MiB"


@pytest.mark.parametrize(
    "spec", [1e19, 1e20, "1e19", "1e400", 2**64, 2**63, "1e999999999", "9" * 60, "-50%", "-0.5", 1.5, "1.5", "2.5e0"]
)
def test_out_of_range_and_negative_budgets_get_one_line(spec):
    with pytest.raises(BudgetError) as err:
        parse_budget(spec)
    assert "\n" not in str(err.value) and "accepted:" in str(err.value)


@pytest.mark.parametrize(
    ("text", "number"), [("1.5", 1.5), ("5e-1", 0.5), ("0.5", 0.5), ("1.0", 1.0), ("1e3", 1e3), ("1", 1), ("2", 2)]
)
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


def _chain(scale):
    from lightning_rotor.chain import Chain

    return Chain.from_dict(
        {
            "version": 1,
            "names": ["a", "b", "c"],
            "input_size": 10 * scale,
            "out_size": [20 * scale, 5 * scale, 7 * scale],
            "saved_size": [30 * scale, 8 * scale, 7 * scale],
            "fwd_time": [1.0, 2.0, 0.5],
            "bwd_time": [3.0, 4.0, 1.0],
            "fwd_tmp": [3, 1, 0],
            "bwd_tmp": [4, 2, 0],
            "loss_tmp": 6,
        }
    )


def test_one_budget_object_resolves_alone_and_shares_between_chains_from_chains_only():
    """The budget object takes Chains (numbers) and hands back bytes; a chain whose share changes is
    told through the function it gave, never through its module."""
    import torch

    from lightning_rotor.planner import min_feasible_budget
    from lightning_rotor.shared_budget import Budget, InfeasibleTotal, split_by_need
    from lightning_rotor.simulate import no_recompute_peak

    cpu = torch.device("cpu")
    small, big = _chain(1), _chain(10)
    alone = Budget("50%")
    assert not alone.shared and alone.bytes_for(big, cpu) == no_recompute_peak(big) // 2
    auto = Budget(None)
    assert not auto.no_recompute  # nothing resolved yet
    assert auto.bytes_for(big, cpu) == no_recompute_peak(big) and auto.no_recompute  # CPU: no recomputation

    total = min_feasible_budget(small) + min_feasible_budget(big) + 50
    shared = Budget(total, ["small", "big"])
    told: list[int] = []

    class Small:  # the first chain's state (`ShareHolder`): told its new shares
        def new_share(self, share: int) -> None:
            told.append(share)

        def busy(self) -> bool:
            return False

    first = shared.bytes_for(small, cpu, name="small", holder=Small())
    assert first == total  # alone so far: the whole total (the other chain has not run yet)
    second = shared.bytes_for(big, cpu, name="big")
    needs = {n: (min_feasible_budget(c), no_recompute_peak(c)) for n, c in (("small", small), ("big", big))}
    expected = split_by_need(total, needs)
    assert second == expected["big"] and shared.shares == expected
    assert told == [expected["small"]]  # the first chain is told its smaller share
    with pytest.raises(InfeasibleTotal, match="smallest feasible budget"):
        Budget(min_feasible_budget(big) - 1, ["big"]).bytes_for(big, cpu, name="big")


@pytest.mark.parametrize(
    ("value", "rate"),
    [
        ("12GB/s", 12e9),
        ("12 GB/s", 12e9),
        ("500MiB/s", 500 * 2**20),
        ("1.5e10", 1.5e10),
        ("25gb/s", 25e9),
        ("2 KiB / s", 2048.0),
        (12_000_000_000, 12e9),
        (1.5e10, 1.5e10),
    ],
)
def test_bandwidths(value, rate):
    assert parse_bandwidth(value) == rate


@pytest.mark.parametrize(
    "value", ["12GB", "fast", "-1GB/s", "0", 0, 0.0, -5, True, None, float("inf"), "12 Gbit/s", "/s", "1e400", ""]
)
def test_bad_bandwidths_say_what_is_accepted_in_one_line(value):
    with pytest.raises(BudgetError) as err:
        parse_bandwidth(value)
    message = str(err.value)
    assert "\n" not in message
    assert "accepted:" in message and "12GB/s" in message and "500MiB/s" in message


def test_format_bandwidth():
    assert format_bandwidth(12e9) == "12 GB/s"
    assert format_bandwidth(parse_bandwidth("500MiB/s")) == "0.5243 GB/s"
