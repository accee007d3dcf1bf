"""mooncake_ops test set-up: one intra-op thread (two shared cores) and the shared helpers
importable as ``_mops_support``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

