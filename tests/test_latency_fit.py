"""experiments/latency_fit.py: the line through (steps, seconds) recovers a known fixed and per-step cost."""

import numpy as np

from experiments import latency_fit


def test_fit_recovers_fixed_and_per_step_costs():
  steps = np.array([3.0, 5.0, 8.0, 13.0, 21.0])
  fixed, per_step = latency_fit.fit(steps, 1.5e-3 + 0.25e-3 * steps)
  np.testing.assert_allclose([fixed, per_step], [1.5e-3, 0.25e-3], rtol=1e-9)
