r"""What the sampled-head loss saves: one training step with head_loss=mean (all k heads projected onto the
vocabulary) against head_loss=random (one drawn head projected, paper §6), per regime.

  python -m experiments.bench_head_loss --config=configs/multi30k_ende.py --k=8

Random weights at the config's model size and vocabulary; a fixed batch of random ids; the real jitted train
step of bpd/train.py. The two programs alternate after compile and warm-up, and each time is a median of
--repeats, so a changing machine load falls on both.
"""

import statistics
import time

from absl import app
from absl import flags
import jax
import numpy as np

from bpd import errors
from bpd import model as model_lib
from bpd import train

_CONFIG = errors.define_config_file('config', 'configs/multi30k_ende.py', 'Model size and vocabulary.')
_K = flags.DEFINE_integer('k', 8, 'Heads.')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Rows per step.')
_LENGTH = flags.DEFINE_integer('length', 32, 'Source and target length.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed steps per program (median).')
_REGIMES = flags.DEFINE_list('regimes', ['finetune', 'frozen'], 'Regimes to time.')


def main(argv):
  del argv
  config = _CONFIG.value
  model_config = model_lib.model_config(config.model.size, vocab_size=config.data.vocab_size, k=_K.value,
                                        dropout_rate=config.model.dropout_rate)
  model = model_lib.Transformer(model_config)
  params = train.fresh_params(model_config, 0)
  rng = np.random.default_rng(0)
  batch = {name: rng.integers(3, model_config.vocab_size, (_BATCH.value, _LENGTH.value)).astype(np.int32)
           for name in ('src_BxS', 'tgt_BxT')}
  print(f'model {config.model.size}, vocab {model_config.vocab_size}, k={_K.value}, batch {_BATCH.value} x '
        f'{_LENGTH.value}, {jax.devices()[0].platform}; median of {_REPEATS.value}, alternating')
  print('| regime | mean (s/step) | random (s/step) | mean / random |\n|---|---|---|---|')
  for regime in _REGIMES.value:
    frozen = regime == 'frozen'
    optimizer = train.make_optimizer(regime, params, 1e-3, 100)
    steps = {loss: train.make_train_step(model, optimizer, seed=0, head_loss=loss, label_smoothing=0.1, frozen=frozen)
             for loss in ('mean', 'random')}
    # Own copies: a train step donates its state's buffers.
    states = {loss: jax.tree.map(lambda x: x.copy(), {'params': params, 'opt_state': optimizer.init(params)})
              for loss in steps}
    times = {loss: [] for loss in steps}
    for i in range(_REPEATS.value + 1):  # the first round compiles and warms up
      for loss, step in steps.items():
        start = time.perf_counter()
        states[loss], out = step(states[loss], batch, i)
        jax.block_until_ready(out['loss'])
        if i:
          times[loss].append(time.perf_counter() - start)
    mean_s, random_s = statistics.median(times['mean']), statistics.median(times['random'])
    print(f'| {regime} | {mean_s:.3f} | {random_s:.3f} | {mean_s / random_s:.2f} |')


if __name__ == '__main__':
  app.run(main, flags_parser=errors.parse_flags)
