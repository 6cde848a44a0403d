"""The public options are declared once, as ``options.AttnOptions``: every keyword of the
three public functions is a field of it with the same default (LAGA's own options only in
``laga_attention``), and ``AttnOptions.of`` hands each keyword through as passed."""
import inspect
from dataclasses import MISSING, fields

import pytest
import torch

from mindspeed_laga import FORMS
from mindspeed_laga.options import AttnOptions, LagaOptions

LAGA_ONLY = {f.name for f in fields(LagaOptions)}


@pytest.mark.parametrize("form", FORMS)
def test_each_keyword_is_a_field_with_its_default(form):
    params = {p.name: p for p in inspect.signature(FORMS[form]).parameters.values()
              if p.kind is p.KEYWORD_ONLY}
    record = {f.name: f for f in fields(AttnOptions) if f.name != "form"}
    if form != "laga":
        record = {n: f for n, f in record.items() if n not in LAGA_ONLY}
    assert set(params) == set(record)
    for name, p in params.items():
        default = record[name].default
        assert p.default == (inspect.Parameter.empty if default is MISSING else default), name


def test_of_takes_every_keyword_as_passed():
    passed = {f.name: object() for f in fields(AttnOptions) if f.name != "form"}
    options = AttnOptions.of("laga", dict(passed, query=torch.zeros(1), form="ignored"))
    assert options.form == "laga"
    assert all(getattr(options, n) is v for n, v in passed.items())
