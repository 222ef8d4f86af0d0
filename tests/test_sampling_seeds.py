"""experiments/sampling_seeds.py: its seed range is checked before anything loads."""

import pytest

from bpd.errors import UserError
from experiments import sampling_seeds


def test_seed_ranges():
  assert list(sampling_seeds.parse_seeds('0-3')) == [0, 1, 2, 3]
  assert list(sampling_seeds.parse_seeds('5')) == [5]


@pytest.mark.parametrize('text', ['3-1', 'a-b', '', '1-'])
def test_bad_seed_ranges_are_clear_errors(text):
  with pytest.raises(UserError, match='FIRST-LAST'):
    sampling_seeds.parse_seeds(text)
