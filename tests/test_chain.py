"""Chain record: validation names the field and the stage; JSON load/save round-trips."""

import json
import math
from pathlib import Path

import pytest

from lightning_rotor.chain import FIELD_VERSION, VERSION_FIELDS, Chain, ChainError, StageProfile


def chain_dict(**changes):
    data = {
        "version": 1,
        "names": ["a", "b", "c"],
        "input_size": 10,
        "out_size": [20, 5, 7],
        "saved_size": [30, 8, 7],
        "fwd_time": [1.0, 2.0, 0.5],
        "bwd_time": [3.0, 4.0, 1.0],
        "fwd_tmp": [3, 1, 0],
        "bwd_tmp": [4, 2, 0],
        "loss_tmp": 6,
    }
    data.update(changes)
    return data


def test_round_trip(tmp_path):
    chain = Chain.from_dict(chain_dict())
    assert chain.length == 3 and chain.sizes == [10, 20, 5, 7]
    path = tmp_path / "chain.json"
    chain.save(path)
    assert Chain.load(path) == chain
    assert Chain.from_dict(json.loads(path.read_text())).to_dict() == chain.to_dict()


@pytest.mark.parametrize("field", ["out_size", "saved_size", "fwd_time", "bwd_time", "fwd_tmp", "bwd_tmp"])
def test_wrong_list_length_names_field(field):
    data = chain_dict()
    data[field] = data[field][:2] if field != "out_size" else data[field] + [1]
    with pytest.raises(ChainError, match=field if field != "out_size" else "entries but out_size"):
        Chain.from_dict(data)


@pytest.mark.parametrize("field", ["out_size", "saved_size", "fwd_tmp", "bwd_tmp"])
@pytest.mark.parametrize("bad", [-1, 2.5, "7", True, math.nan])
def test_bad_size_names_field_and_stage(field, bad):
    data = chain_dict()
    data[field] = list(data[field])
    data[field][1] = bad
    with pytest.raises(ChainError, match=rf"{field}\[1\]"):
        Chain.from_dict(data)


@pytest.mark.parametrize("field", ["input_size", "loss_tmp"])
def test_bad_scalar_size(field):
    with pytest.raises(ChainError, match=field):
        Chain.from_dict(chain_dict(**{field: -5}))


@pytest.mark.parametrize("field", ["fwd_time", "bwd_time"])
@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, "1"])
def test_bad_time_names_field_and_stage(field, bad):
    data = chain_dict()
    data[field] = list(data[field])
    data[field][2] = bad
    with pytest.raises(ChainError, match=rf"{field}\[2\]"):
        Chain.from_dict(data)


def test_integral_float_size_accepted():
    assert Chain.from_dict(chain_dict(input_size=10.0)).input_size == 10


def test_saved_smaller_than_output_accepted():
    # a stage passing tensors of a_k through unchanged (a carried skip) records less than its output:
    # those tensors are a_k's, which is held whenever ā_{k+1} is (Fe k to B k)
    assert Chain.from_dict(chain_dict(saved_size=[1, 8, 7])).saved_size == [1, 8, 7]


def test_unknown_version():
    with pytest.raises(ChainError, match="unknown chain version 7; this release reads versions 1, 2, 3, 4, 5, 6"):
        Chain.from_dict(chain_dict(version=7))


def test_version_6_transfer_fields():
    chain = Chain.from_dict(chain_dict(version=6, bandwidth=12e9, host_limit=1000))
    assert chain.bandwidth == 12e9 and chain.host_limit == 1000 and chain.offloads
    again = Chain.from_dict(chain.to_dict())
    assert again.to_dict()["version"] == 6 and again.bandwidth == 12e9 and again.host_limit == 1000
    assert Chain.from_dict(chain_dict()).to_dict()["version"] == 4  # no transfer fields: an older file
    with pytest.raises(ChainError, match="bandwidth.*need chain version 6"):
        Chain.from_dict(chain_dict(version=5, bandwidth=1e9))
    for bad in (-1.0, float("inf"), "12GB/s", True):
        with pytest.raises(ChainError, match="bandwidth must be a finite number of bytes per second"):
            Chain.from_dict(chain_dict(version=6, bandwidth=bad))
    with pytest.raises(ChainError, match="host_limit"):
        Chain.from_dict(chain_dict(version=6, host_limit=-5))


def test_version_6_offloadable_saved_part():
    chain = Chain.from_dict(chain_dict(version=6, offloadable=[30, 0, 7]))
    assert chain.offloadable == [30, 0, 7]
    data = chain.to_dict()
    assert data["version"] == 6 and data["offloadable"] == [30, 0, 7]  # bandwidth 0, but a saved part to offload
    assert Chain.from_dict(data) == chain
    assert Chain.from_dict(chain_dict()).offloadable == [0, 0, 0]
    assert "offloadable" not in Chain.from_dict(chain_dict(version=6, offloadable=[0, 0, 0])).to_dict()
    with pytest.raises(ChainError, match="offloadable.*need chain version 6"):
        Chain.from_dict(chain_dict(version=5, offloadable=[0, 0, 0]))
    with pytest.raises(ChainError, match=r"offloadable\[1\]=9 is larger than saved_size\[1\]=8"):
        Chain.from_dict(chain_dict(version=6, offloadable=[0, 9, 0]))
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ChainError, match=r"offloadable\[2\] must be a non-negative integer"):
            Chain.from_dict(chain_dict(version=6, offloadable=[0, 0, bad]))
    with pytest.raises(ChainError, match="offloadable must be a list with one entry per stage"):
        Chain.from_dict(chain_dict(version=6, offloadable=[0, 0]))
    # the suffix after a frozen prefix keeps the figures of its own stages
    frozen = Chain.from_dict(chain_dict(version=6, offloadable=[30, 4, 7], frozen=1))
    assert frozen.suffix().offloadable == [4, 7]
    assert frozen.with_transfer(12e9).offloadable == [30, 4, 7]


def test_version_1_files_keep_their_meaning():
    old = Chain.from_dict(chain_dict())
    assert old.out_free == [0, 0, 0] and old.loss_tmp_kept == old.loss_tmp == 6
    assert old.bwd_net == old.bwd_tmp  # nothing released: B k charged exactly as version 1 says
    assert old.to_dict()["version"] == 4 and "out_free" not in old.to_dict() and "in_free" not in old.to_dict()
    assert old.in_free == [0, 0, 0]
    with pytest.raises(ChainError, match="out_free need chain version 2"):
        Chain.from_dict(chain_dict(out_free=[0, 0, 0]))
    with pytest.raises(ChainError, match=r"bwd_tmp\[1\] must be a non-negative"):
        Chain.from_dict(chain_dict(bwd_tmp=[4, -2, 0]))


def test_version_2_signed_transients_and_released_outputs():
    data = chain_dict(version=2, bwd_tmp=[4, -20, -5], loss_tmp=-7, loss_tmp_kept=3, out_free=[20, 0, 7])
    chain = Chain.from_dict(data)
    assert chain.bwd_net == [4 - 20, -20, -5 - 7]
    assert chain.loss_tmp_graph == chain.loss_tmp == -7  # the last stage's graph keeps none of a_L
    assert Chain.from_dict(chain.to_dict()) == chain
    assert Chain.from_dict(dict(data, out_free=[20, 0, 0])).loss_tmp_graph == 3
    with pytest.raises(ChainError, match=r"bwd_tmp\[1\]=-21 is below -20"):  # s_1 = 20: peak below its start
        Chain.from_dict(dict(data, bwd_tmp=[4, -21, 0]))
    with pytest.raises(ChainError, match="loss_tmp=-8 is below -7"):
        Chain.from_dict(dict(data, loss_tmp=-8))
    with pytest.raises(ChainError, match=r"out_free\[1\]=6 is larger than out_size\[1\]=5"):
        Chain.from_dict(dict(data, out_free=[0, 6, 0]))


def test_version_3_stage_inputs_released():
    data = chain_dict(version=3, out_free=[20, 3, 7], in_free=[0, 12, 3])
    chain = Chain.from_dict(data)
    assert chain.in_free == [0, 12, 3]
    assert chain.to_dict()["in_free"] == [0, 12, 3] and Chain.from_dict(chain.to_dict()) == chain
    zeros = Chain.from_dict(dict(data, in_free=[0, 0, 0]))
    assert "in_free" not in zeros.to_dict()  # written only when some stage input is released
    assert zeros == Chain.from_dict({k: v for k, v in data.items() if k != "in_free"})
    for bad, message in [
        ([11, 0, 0], r"in_free\[0\]=11 is larger than input_size=10"),  # only a chain's own part of its input
        ([0, 21, 0], r"in_free\[1\]=21 is larger than out_size\[0\]=20"),
        ([0, 12, 4], r"in_free\[2\]=4 is larger than out_free\[1\]=3"),
        ([0, -1, 0], r"in_free\[1\] must be a non-negative integer"),
        ([0, 2.5, 0], r"in_free\[1\] must be a non-negative integer"),
        ([0, 1], "in_free must be a list with one entry per stage"),
        (7, "in_free must be a list"),
    ]:
        with pytest.raises(ChainError, match=message) as err:
            Chain.from_dict(dict(data, in_free=bad))
        assert "\n" not in str(err.value)
    for version in (1, 2):
        with pytest.raises(ChainError, match=f"in_free need chain version 3; this file says version {version}"):
            Chain.from_dict(chain_dict(version=version, in_free=[0, 0, 0]))
    # the total-size check counts in_free: every field alone is legal, the sum is not
    big = 2**60
    with pytest.raises(ChainError, match="add up to"):
        Chain.from_dict(
            chain_dict(
                version=3,
                input_size=0,
                out_size=[big, 1, 1],
                saved_size=[big, 1, 1],
                out_free=[big, 0, 0],
                in_free=[0, big, 0],
                fwd_tmp=[0] * 3,
                bwd_tmp=[0] * 3,
                loss_tmp=0,
            )
        )


def test_version_2_files_keep_their_meaning():
    """A version-2 file loads as version 3 with nothing of a stage input released, and plans to the same figures."""
    from lightning_rotor.planner import min_feasible_budget, plan
    from lightning_rotor.simulate import no_recompute_peak

    data = chain_dict(version=2, bwd_tmp=[4, -20, -5], loss_tmp=-7, loss_tmp_kept=3, out_free=[20, 0, 7])
    chain = Chain.from_dict(data)
    assert chain.in_free == [0, 0, 0]
    written = chain.to_dict()
    assert written["version"] == 4 and "in_free" not in written
    assert {k: v for k, v in written.items() if k != "version"} == {k: v for k, v in data.items() if k != "version"}
    explicit = Chain.from_dict(dict(data, version=3, in_free=[0, 0, 0]))
    assert explicit == chain
    # the figures version 2 gave this chain (computed before version 3 existed)
    assert (min_feasible_budget(chain), no_recompute_peak(chain)) == (54, 55)
    tight, loose = plan(chain, 54), plan(chain, 55)
    assert [op.label for op in tight.ops] == ["Fe 0", "Fc 1", "Fe 2", "Loss", "B 2", "Fe 1", "B 1", "B 0"]
    assert (tight.peak, tight.time, loose.peak, loose.time, loose.recomputed_stages) == (54, 13.5, 55, 11.5, 0)
    assert plan(explicit, 54) == tight and plan(explicit, 55) == loose


def test_missing_and_unknown_fields():
    data = chain_dict()
    del data["bwd_time"]
    with pytest.raises(ChainError, match="missing field.*bwd_time"):
        Chain.from_dict(data)
    with pytest.raises(ChainError, match="unknown chain field.*colour"):
        Chain.from_dict(chain_dict(colour="red"))


def test_empty_chain_and_not_an_object():
    with pytest.raises(ChainError, match="at least one stage"):
        Chain.from_dict(
            chain_dict(out_size=[], saved_size=[], fwd_time=[], bwd_time=[], fwd_tmp=[], bwd_tmp=[], names=[])
        )
    with pytest.raises(ChainError, match="JSON object"):
        Chain.from_dict([1, 2])


def test_load_errors_are_one_line_and_name_the_file(tmp_path):
    with pytest.raises(ChainError, match="no such chain file") as missing:
        Chain.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1,')
    with pytest.raises(ChainError, match="not valid JSON") as malformed:
        Chain.load(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(chain_dict(fwd_time=[1.0, -2.0, 0.5])))
    with pytest.raises(ChainError, match=r"wrong.json: fwd_time\[1\]") as invalid:
        Chain.load(wrong)
    for err in (missing, malformed, invalid):
        assert "\n" not in str(err.value)


def test_fwd_tmp_nograd_optional_and_checked():
    chain = Chain.from_dict(chain_dict())
    assert chain.fwd_tmp_nograd == chain.fwd_tmp and "fwd_tmp_nograd" not in chain.to_dict()
    lean = Chain.from_dict(chain_dict(fwd_tmp_nograd=[1, 0, 0]))
    assert Chain.from_dict(lean.to_dict()).fwd_tmp_nograd == [1, 0, 0]
    with pytest.raises(ChainError, match=r"fwd_tmp_nograd\[2\]"):
        Chain.from_dict(chain_dict(fwd_tmp_nograd=[1, 0, -4]))
    with pytest.raises(ChainError, match="fwd_tmp_nograd"):
        Chain.from_dict(chain_dict(fwd_tmp_nograd=[1, 0]))


def _hostile(tmp_path, name: str, text: str | bytes) -> Path:
    path = tmp_path / f"{name}.json"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def _with(**changes) -> str:
    return json.dumps(chain_dict(**changes))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_with(out_size=[2**63, 1, 1], saved_size=[2**63, 1, 1]), "more than the 2**62 bytes"),
        (_with(out_size=[2**61] * 3, saved_size=[2**61] * 3), "add up to"),
        (_with(fwd_tmp=[1e300, 0, 0]), "1e+300 bytes, more than"),
        (_with(fwd_time=[1.7e308] * 3), "times are too large"),
        (_with(names=5), "names must be a list"),
        (_with(names="abc"), "names must be a list"),
        (_with(names=[1, 2, 3]), "names must be strings"),
        (_with(loss_tmp=float("nan")), "loss_tmp must be"),
        (_with(version=True), "unknown chain version"),
        (b'{"names": ["\xe9"]}', "not UTF-8"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"input_size": ' + "9" * 5000 + "}", "too many digits"),
    ],
)
def test_hostile_chain_files_get_one_line(tmp_path, text, message):
    with pytest.raises(ChainError) as err:
        Chain.load(_hostile(tmp_path, "hostile", text))
    assert message in str(err.value) and "\n" not in str(err.value) and "hostile.json" in str(err.value)


def test_version_1_example_files_plan_as_before():
    """The example chains are version 1: they load with their old meaning and plan to the figures the README shows."""
    from lightning_rotor.planner import min_feasible_budget, plan

    root = Path(__file__).resolve().parent.parent / "examples"
    chain = Chain.load(root / "resnet50_b32.json")
    assert json.loads((root / "resnet50_b32.json").read_text())["version"] == 1
    assert chain.out_free == [0] * chain.length and chain.bwd_net == chain.bwd_tmp
    assert min_feasible_budget(chain) == 892731392
    result = plan(chain, "50%")
    assert (result.budget, result.peak, result.recomputed_stages) == (2101772288, 2084110336, 5)
    at_500 = plan(chain, "50%", slots=500)  # rotor's own precision, the default before automatic slots
    assert (at_500.peak, at_500.recomputed_stages) == (2032730112, 6) and at_500.time > result.time
    for name in ("gpt2_small_b8.json", "heterogeneous.json"):
        loaded = Chain.load(root / name)
        written = loaded.to_dict()
        assert written["version"] == 4 and "in_free" not in written  # written back as version 4, same figures
        assert loaded.in_free == [0] * loaded.length


def full_chain():
    """A chain with every optional field away from its default: a frozen stage, options, offloading."""
    return Chain.from_dict(
        chain_dict(
            version=6,
            fwd_tmp_nograd=[2, 9, 0],
            out_free=[0, 5, 7],
            loss_tmp_kept=9,
            in_free=[0, 0, 5],
            loss_value=8,
            frozen=1,
            options=[[], [], [{"name": "sac", "saved_size": 7, "fwd_time": 0.6, "bwd_time": 1.2, "fwd_tmp": 1,
                               "bwd_tmp": 2, "out_free": 7}]],
            bandwidth=1e9,
            host_limit=100,
            offloadable=[0, 3, 0],
        )
    )  # fmt: skip


def test_per_stage_records_gather_back_into_the_chain():
    """`Chain.stages` gives each stage's figures as one record; `Chain.from_stages` gathers them back."""
    chain = full_chain()
    stages = chain.stages
    assert [s.name for s in stages] == ["a", "b", "c"]
    assert stages[1].out_size == 5 and stages[1].fwd_tmp_nograd == 9 and stages[1].offloadable == 3
    assert stages[2].options == tuple(chain.options[2]) and stages[2].in_free == 5
    whole = {"input_size": 10, "loss_tmp": 6, "loss_tmp_kept": 9, "loss_value": 8, "frozen": 1}
    assert Chain.from_stages(stages, **whole, bandwidth=1e9, host_limit=100) == chain
    # defaults: fwd_tmp_nograd is fwd_tmp, names stage0 …; checked as any chain
    plain = Chain.from_stages([StageProfile(4, 4, 1.0, 1.0, 2, 0), StageProfile(3, 3, 1.0, 1.0, 0, 0)], input_size=4)
    assert plain.fwd_tmp_nograd == plain.fwd_tmp == [2, 0] and plain.names == ["stage0", "stage1"]
    with pytest.raises(ChainError, match=r"out_free\[0\]=5 is larger than out_size\[0\]=4"):
        Chain.from_stages([StageProfile(4, 4, 1.0, 1.0, 2, 0, out_free=5)], input_size=4)


@pytest.mark.parametrize(("version", "name"), [(v, f) for v, names in VERSION_FIELDS.items() if v > 1 for f in names])
def test_each_field_needs_the_version_that_added_it(version, name):
    """One table says which version adds which field: a file of the version before is refused, and a chain
    holding the field is written as that version (at least 4), which reads it back."""
    data = full_chain().to_dict()
    assert data["version"] == 6
    alone = {k: v for k, v in data.items() if FIELD_VERSION.get(k, 1) < version or k == name}  # none later
    with pytest.raises(ChainError, match=f"field.s. {name} need chain version {version}; this file says version"):
        Chain.from_dict({**alone, "version": version - 1})
    written = Chain.from_dict({**alone, "version": version}).to_dict()
    assert written["version"] == max(version, 4) and name in written
