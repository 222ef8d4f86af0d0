r"""One-step quality of trained super-resolution models: the argmax of head 1 at every sub-pixel given a fixed
prefix (teacher forcing), as PSNR against the ground truth, beside nearest-neighbour enlargement.

Separates what a model predicts one step at a time from what greedy decoding does with its own outputs
(README, Super-resolution: a model whose one-step argmax is near the baseline can still collapse in greedy
decoding, by following its own prefix). Prefixes: the true image, and the nearest-neighbour enlargement.

  python -m experiments.superres_prefix_check --workdirs=runs/sr_colocated/base,runs/sr_noise/base --examples=4
"""

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bpd import checkpoint
from bpd import model as model_lib
from bpd.data import images
from bpd.data import tokenizer as tokenizer_lib

_WORKDIRS = flags.DEFINE_list('workdirs', [], 'trained image models (--workdir of a --mode=train run)')
_DATA = flags.DEFINE_string('data_dir', '../shared/data/celeba32', 'folder with val.npy and val_8x8.npy')
_EXAMPLES = flags.DEFINE_integer('examples', 4, 'first N val faces')


def main(argv):
  del argv
  lowres_Nx8x8x3, highres_Nx32x32x3 = images.load_npy_split(_DATA.value, 'val')
  lowres_Nx8x8x3, highres_Nx32x32x3 = lowres_Nx8x8x3[:_EXAMPLES.value], highres_Nx32x32x3[:_EXAMPLES.value]
  nearest = images.enlarge(lowres_Nx8x8x3)
  src_NxS = jnp.asarray(images.image_to_tokens(lowres_Nx8x8x3))
  prefixes = {'true image': images.image_to_tokens(highres_Nx32x32x3), 'nearest': images.image_to_tokens(nearest)}
  print(f'nearest-neighbour enlargement: {images.psnr(nearest, highres_Nx32x32x3).mean():.2f} dB')
  for workdir in _WORKDIRS.value:
    config, params, step = checkpoint.load_params(workdir)
    model = model_lib.Transformer(config)
    argmax = jax.jit(lambda p, src, tgt_in: jnp.argmax(model.apply({'params': p}, src, tgt_in)[:, :, 0], axis=-1))
    for name, tokens_NxT in prefixes.items():
      # Position p's input is the prefix's sub-pixel p - 1 (BOS at 0); its argmax is the guess for sub-pixel p.
      tgt_in_NxT = np.concatenate([np.full((len(tokens_NxT), 1), tokenizer_lib.BOS_ID), tokens_NxT[:, :-1]], axis=1)
      guess = images.tokens_to_image(np.asarray(argmax(params, src_NxS, jnp.asarray(tgt_in_NxT))))
      print(f'{workdir} step {step}, prefix {name}: one-step argmax '
            f'{images.psnr(guess, highres_Nx32x32x3).mean():.2f} dB')


if __name__ == '__main__':
  app.run(main)
