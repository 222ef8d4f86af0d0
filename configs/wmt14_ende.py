"""WMT14 En->De, the paper's setting (§6): Transformer base (or big) on TFDS wmt14_translate/de-en.

For accelerators (TPU pods, GPUs); docs/scale_out.md has the TPU pod recipe. Needs the TFDS data prepared in the
array_record format (`tfds build wmt14_translate/de-en --file_format=array_record --data_dir=DIR`) and
--config.data.tfds_data_dir=DIR.
  python -m bpd.main --config=configs/wmt14_ende.py:regime=base --workdir=runs/wmt_base
  python -m bpd.main --config=configs/wmt14_ende.py:k=8,regime=finetune --workdir=runs/wmt_k8 \
      --config.train.init_from=runs/wmt_base
Arguments (comma-separated key=value): see ARGS below; an unknown one is an error.
"""

from configs import common

ARGS = {
    'k': common.Arg(8, 'heads of the model'),
    'regime': common.Arg('base', 'what to train', choices=('base', 'frozen', 'finetune')),
    'size': common.Arg('base', 'Transformer base or big (paper §6)', choices=('base', 'big')),
}


def get_config(arg: str | None = None):
  args = common.parse_args(arg, ARGS, 'configs/wmt14_ende.py')
  c = common.defaults()
  c.k = args['k']
  c.model.size = args['size']
  c.data.source = 'tfds'
  c.data.train_split = 'train'
  c.data.eval_split = 'validation'  # newstest2013, the paper's dev set
  c.data.vocab_size = 32000
  c.data.max_len = 256
  c.data.bucket_lengths = (32, 64, 128, 256)
  c.data.max_eval_examples = 1000
  c.train.regime = args['regime']
  c.train.num_steps = 100_000 if c.train.regime == 'base' else 50_000
  c.train.batch_size = 256  # sentences per step, split across devices
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 4000
  c.train.checkpoint_every = 2000
  c.train.eval_every = 5000
  c.decode.splits = ('validation', 'test')  # newstest2013, newstest2014
  c.decode.ks = (1, 2, 4, 6, 8, 10) if c.k >= 10 else tuple(k for k in (1, 2, 4, 6, 8) if k <= c.k)
  c.decode.criteria = ('exact', 'top_k:2', 'min_block:2', 'min_block:3')
  c.decode.batch_sizes = (1, 32)
  c.decode.max_len = 256
  c.distill.beam_size = 4
  c.distill.alpha = 0.6
  c.distill.batch_size = 64
  c.distill.max_len = 256
  return c
