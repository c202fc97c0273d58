"""``python -m benchmarks``: the one benchmark table (see run.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import main  # noqa: E402

main()
