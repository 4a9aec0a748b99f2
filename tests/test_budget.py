import pytest

from remat_compiler import parse_budget
from remat_compiler.budget import human_bytes


@pytest.mark.parametrize("value, nbytes", [(4096, 4096), ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6),
                                           ("1.5 KiB", 1536), ("100", 100), ("1_000B", 1000)])
def test_bytes_forms(value, nbytes):
    assert parse_budget(value).bytes == nbytes
    assert parse_budget(value).fraction is None


def test_numpy_numbers_are_numbers():
    np = pytest.importorskip("numpy")
    assert parse_budget(np.int64(4096)).bytes == 4096
    assert parse_budget(np.float32(0.5)).fraction == 0.5


@pytest.mark.parametrize("value, frac", [(0.5, 0.5), (1.0, 1.0), ("0.25", 0.25), ("5e-1", 0.5), ("1.0", 1.0)])
def test_fraction_forms(value, frac):
    b = parse_budget(value)
    assert b.fraction == frac and b.bytes is None
    assert b.resolve(1000) == int(frac * 1000)


def test_none_is_unlimited():
    assert parse_budget(None).resolve(123) is None


@pytest.mark.parametrize("bad", [0, -5, 1.5, 0.0, float("nan"), "lots", "12 parsecs", True, [1], "-3MB",
                                 "1.5", "1.5B", "1e400", "1e309B", "1e400GiB", "0", "0.0001B"])
def test_bad_budgets_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match="expected a positive int of bytes"):
        parse_budget(bad)


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(3 * 2**20) == "3.00 MiB"
