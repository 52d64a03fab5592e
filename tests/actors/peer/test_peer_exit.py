"""How a peer process ends when it is told to stop before its connection watches signals itself
(while the model loads): code 0, logged like every stop, instead of dying of the signal."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from helpers.timeouts import guard

pytestmark = pytest.mark.integration  # every test here starts a process

TIMEOUT_S = guard(120)
"""A hang guard for a process that normally ends within two seconds (importing torch on a loaded machine)."""
PROCESS = """
import logging, os, signal, sys, time
from specroll.actors.peer.exit import run_stoppable
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
before = signal.getsignal({signum})

def loading_the_model():
    try:
        os.kill(os.getpid(), {signum})  # the launcher stops the run while the model loads
        time.sleep(600)                 # interrupted at once by the handler (else the run times out)
    except Exception as e:  # a loader's own handler (the GGUF reader's) must not swallow the stop
        raise RuntimeError("not a readable GGUF file") from e
    return 7

code = run_stoppable(loading_the_model, logging.getLogger("specroll.generator"), "generator", "g-1")
assert signal.getsignal({signum}) is before, "the process's own handling is not back"
sys.exit(code)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_starting_ends_the_process_with_code_0(signum: int) -> None:
    proc = subprocess.run([sys.executable, "-c", PROCESS.format(signum=int(signum))], capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    name = signal.Signals(signum).name
    assert proc.returncode == 0, proc.stderr
    assert f"generator g-1 exits with code 0: received {name} while starting" in proc.stderr, proc.stderr


def test_the_run_s_own_code_passes_through() -> None:
    code = "from specroll.actors.peer.exit import run_stoppable; import logging, sys; " \
           "sys.exit(run_stoppable(lambda: 3, logging.getLogger('x'), 'generator', 'g-1'))"
    assert subprocess.run([sys.executable, "-c", code], timeout=TIMEOUT_S).returncode == 3


def test_a_connection_reset_in_the_handshake_is_not_blamed_on_security(caplog) -> None:
    """A trainer killed mid-handshake gives HANDSHAKE_FAILED_NO_DETAIL with ECONNRESET (0x68): no hint
    about network.security then, which stays for a failure without a connection error."""
    import errno
    import logging

    import zmq

    from specroll.actors.peer.trainer_liveness import TrainerLiveness

    log = logging.getLogger("test.liveness")
    liveness = TrainerLiveness("tcp://127.0.0.1:9", 10.0, log)
    with caplog.at_level(logging.INFO, logger="test.liveness"):
        liveness._on_handshake_failed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.ECONNRESET)
        assert "ended during its handshake (ECONNRESET)" in caplog.text and "security" not in caplog.text
        assert liveness.why_unreached() == ""
        liveness._on_handshake_failed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
        assert "network.security" in caplog.text and "network.security" in liveness.why_unreached()
