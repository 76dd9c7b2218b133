"""Driver for tests/test_launch_interrupt.py: a stand-in for a notebook kernel whose cells each launch a run.

For every line ``go <STEPS>`` on stdin it launches tests/scripts/steps.py on 2 ranks (named ``interrupt<i>``), and
prints ``@@ returned <i> <ok|interrupted> <time.monotonic()>`` the moment the launch gives control back, then waits
for the next line; ``exit`` ends it. SIGINT raises KeyboardInterrupt while a launch runs, as the kernel's stop button
does; between launches it is ignored, as an idle kernel ignores a press, so that a test may press again and again
around the end of a launch without hitting this script's own code. (A process started in the background by a
non-interactive shell inherits SIGINT ignored, so a handler is installed either way.) SIGUSR1 prints every thread's
stack, for a test whose driver does not come back.
"""
import faulthandler
import os
import signal
import sys
import time

armed = False


def stop_button(signum, frame):
    if armed:
        raise KeyboardInterrupt


signal.signal(signal.SIGINT, stop_button)
faulthandler.register(signal.SIGUSR1)

from helpers import launch  # noqa: E402

print("@@ ready", flush=True)
for i, line in enumerate(sys.stdin):
    if line.split()[:1] != ["go"]:
        break
    steps = line.split()[1]
    print(f"@@ launching {i}", flush=True)
    armed = True
    try:
        launch.torchrun("tests/scripts/steps.py", nproc=2, name=f"interrupt{i}", timeout=300,
                        env={"STEPS": steps, "STEP_S": "0.02"})
        armed = False  # a press as the call returns is raised at the call, and caught below
        outcome = "ok"
    except KeyboardInterrupt:
        armed = False
        outcome = "interrupted"
    returned = time.monotonic()
    print(f"@@ returned {i} {outcome} {returned:.3f}", flush=True)
sys.stdout.flush()
os._exit(0)  # not the seconds of tearing down an interpreter that imported torch
