"""Attention backends behind one interface (``base.AttentionBackend``); the torch one runs anywhere."""

from .base import AttentionBackend, RowSpan
from .torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "RowSpan", "TorchPagedAttention"]
