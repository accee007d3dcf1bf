"""Root tests: the test doubles in ``tests/doubles`` are importable as ``doubles``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
