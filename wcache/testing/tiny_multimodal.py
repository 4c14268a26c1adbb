"""Multimodal entries of :mod:`wcache.testing.tiny_models` (placeholder)."""

from __future__ import annotations
