"""Sequence-level knowledge distillation (Kim & Rush 2016; paper §6.2): `--mode=distill`.

The model in the workdir (the teacher) translates the training sources with beam search; the sources and
its translations are written to {workdir}/distill/train.{src,tgt}, or to config.distill.out_dir. A later run
trains on them with config.data.distilled_from={workdir} (or the out_dir). Distilled targets are more predictable,
so proposal heads are right more often (paper: mean accepted block 3.01 -> 4.69 at k=8, fine-tuned). The paper's
teacher is a second base model, trained with another seed, decoding with beam 4 (§6.1).

Work is done in chunks written as separate files, so an interrupted distillation resumes where it stopped; the
corpus folder's manifest (distill.json) names the teacher and the beam settings, and a folder made by another
teacher or with other settings is refused rather than mixed. Inside a chunk the sources are decoded shortest
first, so that each batch is padded to its own length and its beam search stops with its longest sentence.
Every process decodes (each batch split over all devices, bpd/sharding.py); process 0 alone writes.
"""

import json
import os

from absl import logging
import jax
import numpy as np

from bpd import checkpoint
from bpd import checks
from bpd import decoder as decoder_lib
from bpd import files
from bpd import metrics
from bpd import model as model_lib
from bpd import sharding
from bpd import tasks
from bpd.data import batching
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError

CHUNK = 2048  # sentences per part file
def distill(config, workdir: str) -> str:
  """Writes the distilled corpus; returns its folder."""
  checks.check_distill(config, workdir)
  data = config.data.copy_and_resolve_references()
  data.distilled_from = ''
  mesh = sharding.make_mesh(config.model_axis_size)
  model_config, params, step = checkpoint.load_params(workdir, mesh=mesh, step=config.checkpoint_step)
  tokenizer = tokenizer_lib.load(os.path.join(workdir, tokenizer_lib.MODEL_NAME))
  made = pipeline.read_manifest(pipeline.corpus_dir(config.distill, workdir))
  if made is not None and made.get('step') != step:
    raise UserError(f'{pipeline.corpus_dir(config.distill, workdir)} holds parts translated by step {made.get("step")} of the teacher, '
                    f'not step {step}: distil into another folder (--config.distill.out_dir=...), or read that step '
                    f'with --config.checkpoint_step={made.get("step")}.')
  decoder = decoder_lib.Decoder(model_lib.Transformer(model_config), config.distill.max_len, mesh,
                                matmul_kernel=checks.check_matmul_kernel(config))
  batch_size = sharding.decode_batch_size(config.distill.batch_size, mesh)
  src, _ = pipeline.load_split(data, data.train_split, config.seed)
  out_dir = pipeline.corpus_dir(config.distill, workdir)
  parts_dir = os.path.join(out_dir, 'parts')
  if jax.process_index() == 0:
    os.makedirs(parts_dir, exist_ok=True)
    if pipeline.read_manifest(out_dir) is None:  # checks.check_distill refused a folder of other settings
      files.write_atomic(os.path.join(out_dir, pipeline.MANIFEST),
                         json.dumps({**pipeline.distill_settings(config.distill, workdir), 'step': step, 'sources': len(src)}, indent=1))
  num_chunks = -(-len(src) // CHUNK)
  part_path = lambda chunk: os.path.join(parts_dir, f'part-{chunk:05d}.{data.tgt_lang}')
  # Which parts exist is decided once, before any process writes one: all must decode the same chunks.
  done = {chunk for chunk in range(num_chunks) if os.path.exists(part_path(chunk))}
  logging.info('Distilling %d sentences with the step-%d teacher, beam %d.', len(src), step,
               config.distill.beam_size)

  progress = metrics.Progress(0, num_chunks, 'distill chunks')
  for chunk in range(num_chunks):
    if chunk in done:
      continue
    sentences = src[chunk * CHUNK:(chunk + 1) * CHUNK]
    src_ids, _, _ = batching.encode_pairs(tokenizer, sentences, sentences, data.max_len, truncate=True)
    order = np.argsort([len(ids) for ids in src_ids], kind='stable')  # shortest first: batches of like lengths
    outputs, _ = decoder_lib.run_batches(
        lambda s: decoder.beam(params, s, beam_size=config.distill.beam_size, alpha=config.distill.alpha),
        [src_ids[i] for i in order], batch_size, what=f'distill chunk {chunk + 1}/{num_chunks}')
    lines = [''] * len(sentences)
    for position, index in enumerate(order):
      lines[index] = tokenizer.decode(outputs[position])
    tasks.write_lines(part_path(chunk), lines)
    logging.info('%s', progress.line(chunk + 1))

  if jax.process_index() == 0:  # the writer of every part
    targets = []
    for chunk in range(num_chunks):
      with open(part_path(chunk), encoding='utf-8') as f:
        targets += f.read().split('\n')[:-1]
    # The teacher saw each source cut to data.max_len tokens; a cut source's translation is not a translation
    # of the full source, so such pairs are left out (training drops sources that long anyway).
    fits = [len(ids) + 1 <= data.max_len for ids in tokenizer.encode_batch(src)]  # + 1: EOS
    if not all(fits):
      logging.info('Left %d of %d sources out of the distilled corpus: longer than data.max_len=%d tokens.',
                   fits.count(False), len(src), data.max_len)
    empty = sum(1 for t, f in zip(targets, fits) if f and not t.strip())
    if empty > 0.01 * max(sum(fits), 1):  # training skips such pairs (text_files): a teacher that stops at once
      logging.warning('%d of %d distilled targets are empty (the teacher emitted EOS first): training skips them; '
                      'is the teacher trained?', empty, sum(fits))
    tasks.write_lines(os.path.join(out_dir, f'train.{data.src_lang}'), [s for s, f in zip(src, fits) if f])
    tasks.write_lines(os.path.join(out_dir, f'train.{data.tgt_lang}'), [t for t, f in zip(targets, fits) if f])
  sharding.barrier('distill corpus')  # on return, the corpus exists for every process
  logging.info('Wrote the distilled corpus to %s; train on it with --config.data.distilled_from=%s', out_dir,
               workdir if out_dir == os.path.join(workdir, pipeline.DISTILL_DIR) else out_dir)
  return out_dir
