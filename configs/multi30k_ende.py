"""Multi30k En->De on this team's CPUs: a d=256, 3+3-layer Transformer with a 4k shared vocabulary.

Sized so that a base model trains to a usable greedy BLEU in minutes on 2 cores (DESIGN §7).
  python -m bpd.main --config=configs/multi30k_ende.py --workdir=runs/m30k_base
  python -m bpd.main --config=configs/multi30k_ende.py:runlocal --workdir=/tmp/m30k_smoke   # tiny and short
Arguments (comma-separated key=value, bare booleans): see ARGS below; an unknown one is an error.
"""

from configs import common

ARGS = {
    'k': common.Arg(8, 'heads of the model'),
    'regime': common.Arg('base', 'what to train', choices=('base', 'frozen', 'finetune')),
    'runlocal': common.Arg(False, 'a tiny model for a few steps (a smoke run)'),
}


def get_config(arg: str | None = None):
  args = common.parse_args(arg, ARGS, 'configs/multi30k_ende.py')
  c = common.defaults()
  c.k = args['k']
  c.model.size = 'small'
  c.data.source = 'text'
  c.data.dir = '../shared/data/multi30k'
  c.data.eval_split = 'val'
  c.data.vocab_size = 4000  # k heads project to the vocabulary: a 4k vocabulary halves the cost of k = 8 training
  c.data.max_len = 32
  c.data.bucket_lengths = (16, 24, 32)
  c.train.regime = args['regime']
  c.train.num_steps = 6000
  c.train.batch_size = 64
  c.train.warmup_steps = 1000
  c.decode.splits = ('test_2016_flickr',)
  c.decode.ks = tuple(k for k in (1, 2, 4, 6, 8, 10) if k <= c.k)
  c.decode.max_len = 48
  c.decode.batch_sizes = (1, 32)
  if args['runlocal']:
    c.model.size = 'tiny'
    c.data.vocab_size = 1000
    c.train.num_steps = 20
    c.decode.max_examples = 32
  return c
