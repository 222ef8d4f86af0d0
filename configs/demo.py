"""The demo: the embedded synthetic corpus and a tiny model; base, heads, sweep in a few minutes on 2 CPUs.

  python -m experiments.study --plan=demo --workdir=runs/demo        # all stages, then the table
  python -m bpd.main --config=configs/demo.py --workdir=runs/demo/base                  # one stage by hand
  python -m bpd.main --config=configs/demo.py:regime=finetune --workdir=runs/demo/k4 \
      --config.train.init_from=runs/demo/base
  python -m bpd.main --config=configs/demo.py --workdir=runs/demo/k4 --mode=decode
"""

from configs import common

# Steps of the demo's two training stages (experiments/study.py --plan=demo): short enough for a first run on 2 cores.
BASE_STEPS = 1200
HEAD_STEPS = 600

ARGS = {
    'k': common.Arg(4, 'heads of the model'),
    'regime': common.Arg('base', 'what to train (the head recipe below applies to frozen and finetune)',
                         choices=('base', 'frozen', 'finetune')),
    'steps': common.Arg(BASE_STEPS, 'training steps'),
    'head_type': common.Arg('independent', "proposal heads: the paper's, or each also seeing the previous proposal",
                            choices=('independent', 'sequential')),
}


def get_config(arg: str | None = None):
  args = common.parse_args(arg, ARGS, 'configs/demo.py')
  c = common.defaults()
  c.k = args['k']
  c.model.size = 'mini'
  c.model.dropout_rate = 0.0  # a rule-based corpus: nothing to regularize in a few hundred steps
  c.model.head_type = args['head_type']  # configs/demo.py:regime=finetune,head_type=sequential
  c.data.source = 'synthetic'
  c.data.vocab_size = 400  # the synthetic corpus supports ~500 pieces
  c.data.synthetic_train_size = 20000
  c.data.max_len = 40
  c.data.bucket_lengths = (16, 24, 40)
  c.data.max_eval_examples = 256
  c.train.regime = args['regime']
  c.train.num_steps = args['steps']
  c.train.batch_size = 64
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 100
  c.train.label_smoothing = 0.0
  c.train.checkpoint_every = 300
  c.train.eval_every = 600
  c.train.log_every = 100
  if c.train.regime != 'base':
    # The head recipe (docs/results/demo.md): fresh heads at a high peak rate; when fine-tuning, the trained base
    # at a tenth of it and head 1 weighted as 7 of the 7 + k - 1 loss shares, so the base learns to carry the next
    # tokens for the heads without losing its own next-token quality (at one rate for all and the plain mean,
    # fine-tuning for acceptance wrecked the base's BLEU). Set through the config argument
    # (configs/demo.py:regime=finetune): a later --config.train.regime flag does not apply it.
    c.train.head_learning_rate = 3e-3
    c.train.eval_every = 150  # four points of the agreement diagnostic against head-training steps
  if c.train.regime == 'finetune':
    c.train.learning_rate = 3e-4
    c.train.head1_weight = 7.0
  c.decode.splits = ('test',)
  c.decode.ks = tuple(k for k in (2, 3, 4) if k <= c.k)
  c.decode.criteria = ('exact', 'top_k:2', 'min_block:2')
  c.decode.batch_sizes = (32,)
  c.decode.max_len = 40
  c.decode.max_examples = 500
  c.distill.max_len = 40
  return c
