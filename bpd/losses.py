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


def _masked_cross_entropy(logits_Nx___xV, targets_Nx___, label_smoothing, axes):
  """Mean cross-entropy and accuracy over the non-padding targets (id > 0), reduced over `axes`, and the count."""
  weights = (targets_Nx___ > 0).astype(jnp.float32)
  soft = optax.smooth_labels(jax.nn.one_hot(targets_Nx___, logits_Nx___xV.shape[-1]), label_smoothing)
  ce = optax.softmax_cross_entropy(logits_Nx___xV.astype(jnp.float32), soft)
  correct = (jnp.argmax(logits_Nx___xV, axis=-1) == targets_Nx___).astype(jnp.float32)
  count = jnp.sum(weights, axis=axes)
  denom = jnp.maximum(count, 1.0)
  return jnp.sum(ce * weights, axis=axes) / denom, jnp.sum(correct * weights, axis=axes) / denom, count


def heads_cross_entropy(logits_BxTxKxV: jax.Array, tgt_BxT: jax.Array, label_smoothing: float = 0.0):
  """Per-head mean cross-entropy and accuracy over non-padding targets.

  Returns (loss_K [k] float32, accuracy_K [k] float32, weight_K [k] number of targets per head).
  With label smoothing the loss is against the smoothed distribution (Szegedy et al. 2016); the
  constant entropy term is left in, as in flax examples/wmt, so a perfect model does not reach 0.
  """
  targets_BxTxK = head_targets(tgt_BxT, logits_BxTxKxV.shape[-2])
  return _masked_cross_entropy(logits_BxTxKxV, targets_BxTxK, label_smoothing, axes=(0, 1))


def head_targets_at(tgt_BxT: jax.Array, k: int, head) -> jax.Array:
  """Targets of one head (0-based, may be traced): [B, T], [:, t] = tgt[:, t + head], 0 past the end."""
  padded = jnp.pad(tgt_BxT, ((0, 0), (0, k - 1)))
  return jax.lax.dynamic_slice_in_dim(padded, head, tgt_BxT.shape[1], axis=1)


def one_head_cross_entropy(logits_BxTxV: jax.Array, tgt_BxT: jax.Array, k: int, head, label_smoothing: float = 0.0):
  """Mean cross-entropy and accuracy of one head (0-based, may be traced) over its non-padding targets.

  Returns (loss [], accuracy [], weight [] number of targets), as heads_cross_entropy does per head.
  """
  return _masked_cross_entropy(logits_BxTxV, head_targets_at(tgt_BxT, k, head), label_smoothing, axes=(0, 1))
