"""The number arguments of the ``vllm-compat`` commands: a value that is not a number, or
out of range, is refused with a line naming it (argparse turns it into exit 2)."""

from __future__ import annotations

import argparse

import pytest

from vllm_compat.cli_args import non_negative_int, positive_float, positive_int


@pytest.mark.parametrize(("parse", "value", "message"), [
    (positive_int, "x", "'x' is not an integer"),
    (positive_int, "1.5", "'1.5' is not an integer"),
    (positive_int, "0", "0 must be 1 or more"),
    (non_negative_int, "two", "'two' is not an integer"),
    (non_negative_int, "-1", "-1 must be 0 or more"),
    (positive_float, "a", "'a' is not a number"),
    (positive_float, "0", "0 must be above 0"),
    (positive_float, "nan", "nan must be above 0"),
])
def test_a_bad_number_is_refused_naming_it(parse, value, message):
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse(value)
    assert str(exc.value) == message


def test_good_numbers_come_back_typed():
    assert positive_int("3") == 3 and type(positive_int("3")) is int
    assert non_negative_int("0") == 0
    assert positive_float("0.25") == 0.25 and type(positive_float("2")) is float
