"""helpers.rank.runtime: end_rank, how every course script leaves after a successful run (see the module's docstring for
the gloo worker-thread abort it avoids), and forget_deepspeed_shm_buffer."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_end_rank_flushes_output_exits_with_the_code_and_skips_interpreter_teardown(tmp_path):
    marker = tmp_path / "finalized"
    result = _run(f"""
        import atexit, logging, sys
        from pathlib import Path
        from helpers.rank.runtime import end_rank
        atexit.register(Path({str(marker)!r}).write_text, "teardown ran")
        logging.basicConfig(stream=sys.stderr)
        print("buffered, no newline", end="")        # stdout is a pipe: block-buffered, unflushed
        sys.stderr.write("stderr too")
        logging.getLogger("rank").warning("logged")
        end_rank(3)
        print("never reached")
        """, tmp_path)
    assert result.returncode == 3
    assert result.stdout == "buffered, no newline"
    assert "stderr too" in result.stderr and "logged" in result.stderr
    assert not marker.exists(), "atexit ran: the interpreter was finalized"


def test_end_rank_of_none_is_success(tmp_path):
    result = _run("""
        from helpers.rank.runtime import end_rank
        def main():
            print("done")
        end_rank(main())
        """, tmp_path)
    assert (result.returncode, result.stdout) == (0, "done\n")


def test_a_failing_main_still_raises_with_its_traceback(tmp_path):
    """end_rank is only reached on success; a failure must keep Python's traceback (torchrun's error file too)."""
    result = _run("""
        from helpers.rank.runtime import end_rank
        def main():
            raise RuntimeError("rank broke")
        end_rank(main())
        """, tmp_path)
    assert result.returncode == 1
    assert "RuntimeError: rank broke" in result.stderr


def _module_level_calls(tree: ast.Module) -> list[str]:
    """The source of each statement at module level (or under ``if __name__ == "__main__":``) that calls main."""
    found = []
    for node in tree.body:
        body = node.body if isinstance(node, ast.If) else [node]
        found += [ast.unparse(n) for n in body if isinstance(n, ast.Expr) and "main()" in ast.unparse(n)]
    return found


def test_every_distributed_course_script_ends_through_end_rank():
    scripts = [p for p in sorted((ROOT / "course").glob("*.py"))
               if "init_process_group" in p.read_text() or "init_distributed" in p.read_text()]
    assert len(scripts) >= 10  # the check is about something
    for path in scripts:
        calls = _module_level_calls(ast.parse(path.read_text()))
        assert calls == ["end_rank(main())"], f"{path.name} ends with {calls}; use end_rank(main())"


@pytest.mark.slow
def test_forget_deepspeed_shm_buffer_removes_this_ranks_name_after_the_barrier(tmp_path):
    """A one-rank gloo group stands in for DeepSpeed's ranks: the buffer named after this rank, address and port
    goes; another rank's stays (it is that rank's to remove)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    port = free_port()
    mine = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")
    other = mine.with_name(mine.name[:-1] + "1")
    try:
        mine.write_bytes(b"x")
        other.write_bytes(b"x")
        result = _run(f"""
            import os
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
            import torch.distributed as dist
            from helpers.rank.runtime import forget_deepspeed_shm_buffer
            dist.init_process_group("gloo")
            forget_deepspeed_shm_buffer(0)
            dist.destroy_process_group()
            """, tmp_path)
        assert result.returncode == 0, result.stderr
        assert not mine.exists()
        assert other.exists()
    finally:
        mine.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
