"""``benchmarks.vllm_servers.ServeProcess`` started from a process that ignores SIGINT (a
non-interactive shell's background job: how CI and the device tool may start a benchmark):
its servers must still take ``stop_all``'s SIGINT, or every stop waits for SIGKILL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child that starts with SIGINT ignored: start a server that reports the SIGINT
# disposition it was started with, then stop it the way the benchmarks do.
_DRIVER = """
import signal, sys, time
from pathlib import Path
from benchmarks.vllm_servers import ServeProcess, stop_all

signal.signal(signal.SIGINT, signal.SIG_IGN)
log = Path(sys.argv[1])
child = "import signal, time; print(signal.getsignal(signal.SIGINT), flush=True); time.sleep(600)"
server = ServeProcess([sys.executable, "-c", child], {}, 1, log, "probe")
while not log.read_text():
    time.sleep(0.05)
stop_all([server])
print("exit", server.proc.returncode)
"""


def test_a_server_started_while_sigint_is_ignored_takes_sigint(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("")
    run = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(log)], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "default_int_handler" in log.read_text()
    # it ended on SIGINT (KeyboardInterrupt: exit 1 or -2), not on the SIGKILL fallback (-9)
    assert run.stdout.strip() in ("exit 1", "exit -2")
