"""experiments/diagnostics.py --mode=sampling_seeds: its seed range is checked before anything loads."""

import pytest

from bpd.errors import UserError
from experiments import diagnostics


def test_seed_ranges():
  assert list(diagnostics.parse_seeds('0-3')) == [0, 1, 2, 3]
  assert list(diagnostics.parse_seeds('5')) == [5]


@pytest.mark.parametrize('text', ['3-1', 'a-b', '', '1-'])
def test_bad_seed_ranges_are_clear_errors(text):
  with pytest.raises(UserError, match='FIRST-LAST'):
    diagnostics.parse_seeds(text)
