"""The blog's ``__main__`` block, run safely: a training script that launches torchrun on itself.

The blog's script ends with ``if __name__ == "__main__":`` building ``python -m torch.distributed.run
--nproc_per_node N --master_port 29500 ddp_cifar10.py`` and running it, instead of calling ``main()``. torchrun then
starts N copies of the same file, each copy runs that ``__main__`` block again and starts N more, and so on: N
processes in generation 1, N*N in generation 2, ... and ``main()`` never runs.

    python course/pitfall_self_relaunch.py       # NPROC copies per launch (2), port BLOG_PORT (the blog's 29500)

The course's one addition is a safety cap: generation RELAUNCH_CAP (default 2) stops instead of launching again, so
the demonstration ends on its own (notebook 02 also bounds it with a timeout and kills the whole tree). A capped copy
exits 0: had it failed, its torchrun would stop the sibling copies, and under load some of them would be stopped
before they could say they reached the cap (seen on a loaded machine: 2 of the 4 lines), so the count would vary.
The fix is not in this file: the script *is* the rank program (its ``__main__`` calls ``main()``), and it is started from
outside with torchrun (``course/ddp_cifar10.py``).
"""
import os
import subprocess
import sys


def main():
    """The training the blog meant to run."""
    print("main() ran: training starts", flush=True)


if __name__ == "__main__":
    generation = int(os.environ.get("RELAUNCH_GENERATION", "0"))
    who = f"generation {generation}" + (f", RANK {os.environ['RANK']}" if "RANK" in os.environ else "")
    if generation >= int(os.environ.get("RELAUNCH_CAP", "2")):
        print(f"[{who}] safety cap reached: the blog's script would launch torchrun once more here", flush=True)
        sys.exit(0)
    world_size = int(os.environ.get("NPROC", "2"))  # the blog: torch.cuda.device_count()
    port = os.environ.get("BLOG_PORT", "29500")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size), "--master_port", port,
           __file__]
    print(f"[{who}] launching torchrun --nproc_per_node {world_size} on this same file", flush=True)
    child_env = {**os.environ, "RELAUNCH_GENERATION": str(generation + 1)}
    code = subprocess.run(cmd, env=child_env).returncode
    print(f"[{who}] its torchrun exited with code {code}", flush=True)
    sys.exit(code)
