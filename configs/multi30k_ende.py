"""Multi30k En->De on this team's CPUs: a d=256, 3+3-layer Transformer with a 4k shared vocabulary.

DESIGN §7 measured ~0.85 s/step at batch 64 with length buckets 16/24/32, greedy val BLEU ~20 after 12 min.
  python -m bpd.main --config=configs/multi30k_ende.py --workdir=runs/m30k_base
Arguments (comma-separated key=value): k (default 8), regime (base|frozen|finetune), runlocal (tiny and short).
"""

from configs import common


def get_config(arg: str | None = None):
  args = dict(a.split('=', 1) for a in arg.split(',')) if arg else {}
  c = common.defaults()
  c.k = int(args.get('k', 8))
  c.model.size = 'small'
  c.data.source = 'text'
  c.data.dir = '../shared/data/multi30k'
  c.data.eval_split = 'val'
  c.data.vocab_size = 4000  # k heads project to the vocabulary: a 4k vocabulary halves the cost of k = 8 training
  c.data.max_len = 32
  c.data.bucket_lengths = (16, 24, 32)
  c.train.regime = args.get('regime', 'base')
  c.train.num_steps = 6000
  c.train.batch_size = 64
  c.train.warmup_steps = 1000
  c.decode.splits = ('test_2016_flickr',)
  c.decode.ks = tuple(k for k in (1, 2, 4, 6, 8, 10) if k <= c.k)
  c.decode.max_len = 48
  c.decode.batch_sizes = (1, 32)
  if 'runlocal' in args:
    c.model.size = 'tiny'
    c.data.vocab_size = 1000
    c.train.num_steps = 20
    c.decode.max_examples = 32
  return c
