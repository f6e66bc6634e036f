"""Deterministic cases for behaviour that mutation testing (``tools/mutate.py``) found unpinned."""

from __future__ import annotations

import torch

import fzero
