r"""CelebA 8x8 -> 32x32 super-resolution (paper §7.2) with k = 10 heads; a CPU variant that trains here.

The paper (DESIGN §2): an Image Transformer (Parmar et al. 2018) conditioned on the 8x8 image writes the
32x32x3 image as 3072 sub-pixel intensities (raster order, R, G, B; 256 classes each), k = 10, criteria
`exact` and `distance:2`; mean accepted block sizes 1.10 (frozen, exact), 1.40 (frozen, eps=2), 2.04
(fine-tuned, exact), 6.79 (fine-tuned, eps=2). The paper does not give the image model's size here; the
default below is a d=512, 6+6-layer Transformer (model.size=base) with local 1D block self-attention of 256
positions in the decoder (Image Transformer's local 1D attention; block size our assumption), for
accelerators.

Arguments (comma-separated key=value; booleans may be bare, `cpu,prior,colocated`): see ARGS below; an unknown
one or a bad value is an error. `colocated` and `prior` are DEVIATIONS from the paper and the Image Transformer,
off by default so that the faithful model is what every other argument gives.

  python -m bpd.main --config=configs/celeba_sr.py:cpu --workdir=runs/sr/base
  python -m bpd.main --config=configs/celeba_sr.py:cpu,regime=finetune --workdir=runs/sr/finetune \
      --config.train.init_from=runs/sr/base
  python -m bpd.main --config=configs/celeba_sr.py:cpu --workdir=runs/sr/finetune --mode=decode
  python -m experiments.study --plan=superres --config=configs/celeba_sr.py:cpu --workdir=runs/sr_study   # all stages
  python -m bpd.main --config=configs/celeba_sr.py:cpu,colocated --workdir=runs/sr_colocated/base    # not faithful
  # The CPU model of docs/results/table2_celeba.md:
  python -m experiments.study --plan=superres --config=configs/celeba_sr.py:cpu,prior,colocated \
      --workdir=runs/sr_table2 --base_steps=3000 --head_steps=400 --ks=2,4,6,8,10 --batch_sizes=16,1 --max_examples=16 \
      --batch1_examples=2 --config.train.input_noise=40 --config.decode.timing_repeats=1

CPU variant (`cpu`): image_tiny (d=64, 1 encoder + 2 decoder layers, ff 256, 4 attention heads), local
attention blocks of 128, batch 4 images (4 x 3072 target positions), few base and head steps (the study sets both
with --base_steps / --head_steps), and a sweep of 32 validation images: sized to train and decode in tens of
minutes on one CPU core (docs/results/table2_celeba.md has the measured times). The k = 10 step costs several
base steps: the multi-output layer and 10 vocabulary projections at 3072 positions per image dominate this tiny
model.
"""

from configs import common

# Sigma of `prior` given bare: the RMS error of bicubic enlargement on the train faces, in intensity levels.
PRIOR_SIGMA = 26.0

ARGS = {
    'k': common.Arg(10, 'heads of the model'),
    'regime': common.Arg('base', 'what to train', choices=('base', 'frozen', 'finetune')),
    'cpu': common.Arg(False, 'the CPU variant below'),
    'gpu': common.Arg(False, 'image_medium (d=256, 2 + 4 layers, batch 32) for a time-boxed run on one '
                      'accelerator (experiments/study.py --plan=superres --timebox)'),
    'runlocal': common.Arg(False, 'cpu, shrunk to a smoke run of a few steps'),
    'colocated': common.Arg(False, 'config.model.colocated_input: each decoder position also gets the embedding of '
                            'the input sub-pixel that covers the sub-pixel it predicts (README, "Co-located input")'),
    'prior': common.Arg(0.0, 'config.model.output_prior_sigma: every head\'s logits get a Gaussian log-prior of this '
                        'width (intensity levels) around the bicubic enlargement of the input (README, "Output prior")',
                        bare=PRIOR_SIGMA),
}


def get_config(arg: str | None = None):
  args = common.parse_args(arg, ARGS, 'configs/celeba_sr.py')
  c = common.defaults()
  c.k = args['k']
  c.model.size = 'base'
  c.model.attention_block = 256
  c.model.image_positions = True  # Image Transformer's 2D (row; column, channel) positions, input and output
  # Not in the paper: the co-located input sub-pixel's embedding added at each decoder position (README,
  # "Co-located input"). Needs image_positions (the 2D layout). Off: the faithful model.
  c.model.colocated_input = args['colocated']
  # Not in the paper: a Gaussian log-prior on every head's logits around the bicubic enlargement of the input
  # (README, "Output prior"). Off (0): the faithful model.
  c.model.output_prior_sigma = args['prior']
  c.model.dropout_rate = 0.1
  c.data.source = 'images'
  c.data.image_source = 'npy'
  c.data.dir = '../shared/data/celeba32'  # 4560 train / 780 val faces (SOURCE.md); or image_source=tfds
  c.data.train_split = 'train'
  c.data.eval_split = 'val'
  c.data.max_eval_examples = 256
  c.train.regime = args['regime']
  c.train.num_steps = 100000
  c.train.batch_size = 32
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 4000
  c.train.label_smoothing = 0.0  # pixel intensities: keep the argmax sharp for distance acceptance
  c.train.eval_every = 5000
  c.train.checkpoint_every = 2000
  c.train.log_every = 200
  c.decode.splits = ('val',)
  c.decode.ks = tuple(k for k in (1, 2, 4, 6, 8, 10) if k <= c.k)
  c.decode.criteria = ('exact', 'distance:2')
  c.decode.batch_sizes = (1,)
  c.decode.max_len = 3072  # the whole image; less decodes only its first sub-pixels (tests, smoke runs)
  c.decode.max_examples = 64
  c.decode.grid_examples = 8
  if args['cpu'] or args['runlocal']:
    c.model.size = 'image_tiny'
    c.model.attention_block = 128
    c.model.dropout_rate = 0.0  # half an epoch of 4560 faces: too short to overfit
    c.data.max_eval_examples = 32
    # Base and k = 10 heads each train in minutes on one core (the step times: docs/results/table2_celeba.md).
    c.train.num_steps = 600 if c.train.regime == 'base' else 150
    c.train.batch_size = 4
    c.train.learning_rate = 2e-3
    c.train.warmup_steps = 100
    c.train.eval_every = 0 if args['runlocal'] else c.train.num_steps  # at the end only
    c.train.checkpoint_every = 50
    c.train.log_every = 25
    c.decode.ks = tuple(k for k in (2, 4, 10) if k <= c.k)
    c.decode.max_examples = 32
  if args['gpu']:
    # One accelerator for minutes (study.py --plan=superres --timebox): each stage trains under `timeout`, whose
    # SIGTERM stops training with a checkpoint (the preemption path), so num_steps is only an upper bound
    # (docs/results/gpu.md has the measured step rates).
    c.model.size = 'image_medium'
    c.model.dropout_rate = 0.0  # minutes of training: too few epochs of 4560 faces to overfit
    c.train.num_steps = 50000
    c.train.batch_size = 32
    c.train.learning_rate = 2e-3
    c.train.warmup_steps = 500
    c.train.eval_every = 0  # the decode stage measures quality; the logs have the training accuracies
    c.train.checkpoint_every = 1000
    c.train.log_every = 100
    c.decode.ks = (c.k,)
    c.decode.max_examples = 8
    c.decode.timing_examples = 2
    c.decode.timing_repeats = 3
  if args['runlocal']:
    c.train.num_steps = 20
    c.train.checkpoint_every = 10
    c.train.log_every = 5
    c.data.max_eval_examples = 8
    c.decode.max_examples = 2
    c.decode.max_len = 256
  return c
