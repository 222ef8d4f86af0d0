"""Training loss of the k-head model (paper §6): the mean of the heads' cross-entropies.

Head i at decoder position t (input y_t, y_0 = BOS) predicts y_{t+i}, i.e. target index t + i - 1.
"""

import jax
import jax.numpy as jnp
import optax


def head_targets(tgt_BxT: jax.Array, k: int) -> jax.Array:
  """Targets of each head: [B, T, k], [:, t, i-1] = tgt[:, t + i - 1], 0 (padding) past the end."""
  length = tgt_BxT.shape[1]
  padded = jnp.pad(tgt_BxT, ((0, 0), (0, k - 1)))
  return jnp.stack([padded[:, i:i + length] for i in range(k)], axis=-1)


def heads_cross_entropy(logits_BxTxKxV: jax.Array, tgt_BxT: jax.Array, label_smoothing: float = 0.0):
  """Per-head mean cross-entropy and accuracy over non-padding targets.

  Returns (loss_K [k] float32, accuracy_K [k] float32, weight_K [k] number of targets per head).
  With label smoothing the loss is against the smoothed distribution (Szegedy et al. 2016); the
  constant entropy term is left in, as in flax examples/wmt, so a perfect model does not reach 0.
  """
  k, vocab = logits_BxTxKxV.shape[-2:]
  targets_BxTxK = head_targets(tgt_BxT, k)
  weights_BxTxK = (targets_BxTxK > 0).astype(jnp.float32)
  soft = optax.smooth_labels(jax.nn.one_hot(targets_BxTxK, vocab), label_smoothing)
  ce_BxTxK = optax.softmax_cross_entropy(logits_BxTxKxV.astype(jnp.float32), soft)
  correct_BxTxK = (jnp.argmax(logits_BxTxKxV, axis=-1) == targets_BxTxK).astype(jnp.float32)
  weight_K = jnp.sum(weights_BxTxK, axis=(0, 1))
  denom_K = jnp.maximum(weight_K, 1.0)
  loss_K = jnp.sum(ce_BxTxK * weights_BxTxK, axis=(0, 1)) / denom_K
  acc_K = jnp.sum(correct_BxTxK * weights_BxTxK, axis=(0, 1)) / denom_K
  return loss_K, acc_K, weight_K


def head_targets_at(tgt_BxT: jax.Array, k: int, head) -> jax.Array:
  """Targets of one head (0-based, may be traced): [B, T], [:, t] = tgt[:, t + head], 0 past the end."""
  padded = jnp.pad(tgt_BxT, ((0, 0), (0, k - 1)))
  return jax.lax.dynamic_slice_in_dim(padded, head, tgt_BxT.shape[1], axis=1)


def one_head_cross_entropy(logits_BxTxV: jax.Array, tgt_BxT: jax.Array, k: int, head, label_smoothing: float = 0.0):
  """Mean cross-entropy and accuracy of one head (0-based, may be traced) over its non-padding targets.

  Returns (loss [], accuracy [], weight [] number of targets), as heads_cross_entropy does per head.
  """
  targets_BxT = head_targets_at(tgt_BxT, k, head)
  weights_BxT = (targets_BxT > 0).astype(jnp.float32)
  soft = optax.smooth_labels(jax.nn.one_hot(targets_BxT, logits_BxTxV.shape[-1]), label_smoothing)
  ce_BxT = optax.softmax_cross_entropy(logits_BxTxV.astype(jnp.float32), soft)
  correct_BxT = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT).astype(jnp.float32)
  weight = jnp.sum(weights_BxT)
  denom = jnp.maximum(weight, 1.0)
  return jnp.sum(ce_BxT * weights_BxT) / denom, jnp.sum(correct_BxT * weights_BxT) / denom, weight
