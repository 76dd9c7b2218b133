"""Fixture: every rank prints where it runs from (an absolute path under the course root); with FAIL=1, rank 1
then raises with that path in its message."""
import os
import sys
from pathlib import Path

from helpers.rank.runtime import end_rank

here = Path(__file__).resolve()
print(f"rank {os.environ['RANK']} runs {here}", flush=True)
if os.environ.get("FAIL") == "1" and os.environ["RANK"] == "1":
    raise RuntimeError(f"planned failure in {here}")
sys.stdout.flush()
end_rank()
