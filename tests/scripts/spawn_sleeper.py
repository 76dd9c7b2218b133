"""Fixture: starts a child in a session of its own that sleeps for a minute, prints the child's pid, then sleeps
itself: a plain run of it only ends by its timeout, and the child must not outlive it."""
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(f"child {child.pid}", flush=True)
time.sleep(60)
