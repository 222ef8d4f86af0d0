r"""Per-head agreement with greedy decoding on images: the diagnostic behind exact and distance:EPS acceptance.

  python -m experiments.superres_agreement --workdirs=runs/sr_table2/frozen,runs/sr_table2/finetune \
      --examples=4 --eps=2

For each k-head model: teacher-force it on its own greedy output (WORKDIR/decode_<split>/<split>.greedy.b<B>.npy,
written by the decode sweep) and count, per head i, how often head i's argmax at decoder position t equals
greedy's sub-pixel at t + i (exact acceptance, paper §5) and how often it is within EPS intensity levels
(distance:EPS). Also: how often head 1 itself is within EPS of the *previous* greedy sub-pixel of the same
channel, a measure of how much of the image is flat enough for any head to guess.
"""

import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bpd import checkpoint
from bpd import model as model_lib
from bpd.data import images
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from configs import celeba_sr

_WORKDIRS = flags.DEFINE_list('workdirs', [], 'k-head image models whose decode_<split>/ holds a greedy decode.')
_SPLIT = flags.DEFINE_string('split', 'val', 'The decoded split.')
_BATCH = flags.DEFINE_integer('batch_size', 16, 'Batch size of the greedy decode to read (<split>.greedy.b<B>.npy).')
_EXAMPLES = flags.DEFINE_integer('examples', 4, 'Images to teacher-force (the first ones of the split).')
_EPS = flags.DEFINE_integer('eps', 2, 'Intensity distance of the approximate criterion (distance:EPS).')


def agreement(workdir, split, batch_size, examples, eps):
  """Returns (exact_K, within_eps_K): per head, the fraction of positions where it matches greedy."""
  model_config, params, _ = checkpoint.load_params(workdir)
  greedy_Nx32x32x3 = np.load(os.path.join(workdir, f'decode_{split}', f'{split}.greedy.b{batch_size}.npy'))[:examples]
  data = celeba_sr.get_config('cpu').data
  lowres_Nx8x8x3, _ = pipeline.load_image_split(data, split, examples)
  src_NxS = jnp.asarray(images.image_to_tokens(lowres_Nx8x8x3))
  tgt_NxT = jnp.asarray(images.image_to_tokens(greedy_Nx32x32x3))
  tgt_in_NxT = jnp.pad(tgt_NxT[:, :-1], ((0, 0), (1, 0)), constant_values=tokenizer_lib.BOS_ID)
  model = model_lib.Transformer(model_config)
  heads_NxTxK = np.asarray(jax.jit(lambda p, s, t: jnp.argmax(model.apply({'params': p}, s, t), axis=-1))(
      params, src_NxS, tgt_in_NxT))
  tgt = np.asarray(tgt_NxT)
  exact, near = [], []
  for i in range(model_config.k):  # head i + 1 at position t predicts target index t + i
    proposed, truth = heads_NxTxK[:, :tgt.shape[1] - i, i], tgt[:, i:]
    exact.append(np.mean(proposed == truth))
    near.append(np.mean(np.abs(proposed.astype(int) - truth) <= eps))
  return np.array(exact), np.array(near)


def main(argv):
  del argv
  for workdir in _WORKDIRS.value:
    exact_K, near_K = agreement(workdir, _SPLIT.value, _BATCH.value, _EXAMPLES.value, _EPS.value)
    print(f'{workdir}: agreement with greedy, heads 1..{len(exact_K)}')
    print('  exact:       ' + ' '.join(f'{a:.2f}' for a in exact_K))
    print(f'  within {_EPS.value}:    ' + ' '.join(f'{a:.2f}' for a in near_K))


if __name__ == '__main__':
  app.run(main)
