"""Autograd functions that stand in for PyTorch's ops under :func:`actune.compressed` and keep
less for backward: packed values, masks, derivatives, offsets. The rules
(:mod:`actune.rules`) choose which runs for a call; each module here holds one family:
``functions`` (linear layers, convolutions, activations, softmax, dropout), ``fused`` (a layer
norm or RMSNorm fused with what reads it), ``lean_batch_norm``, ``max_pool_offsets``,
``grid_sample``, ``multihead`` (``F.multi_head_attention_forward`` decomposed) and
``lazy_logits`` (a language model's head and loss without the whole logits)."""
