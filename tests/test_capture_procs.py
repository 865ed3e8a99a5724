"""pipelines.procs: a child's whole tree is ended (SIGKILL after the grace for what ignores SIGTERM), and SIGTERM /
SIGHUP become an exception once."""
import os
import signal
import subprocess
import sys
import time

import pytest

from pipelines import procs

pytestmark = pytest.mark.smoke

# a parent that starts a grandchild ignoring SIGTERM, prints the grandchild's pid, and waits
TREE = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
g.stdout.readline()
print(g.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("own_session", [True, False])
def test_end_takes_the_whole_tree_sigkill_after_the_grace(own_session):
    p = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True,
                         start_new_session=own_session)
    grandchild = int(p.stdout.readline())
    assert procs.alive(grandchild) and grandchild in procs.descendants(p.pid)
    t = time.monotonic()
    procs.end([p], own_session=own_session, grace=1.0)
    assert p.returncode is not None and time.monotonic() - t < 10
    for _ in range(100):  # the grandchild's parent is gone: it is reaped by whoever adopted it
        if not procs.alive(grandchild):
            break
        time.sleep(0.05)
    assert not procs.alive(grandchild)


def test_end_of_ended_children_does_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    procs.end([p], own_session=False)
    assert p.returncode == 0


def test_signals_raise_once_then_restore():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(procs.Terminated) as e:
        with procs.signals_raise():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
    assert str(e.value) == "SIGTERM" and procs.exit_code(e.value) == 143
    assert procs.describe(e.value) == "terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(KeyboardInterrupt):
        with procs.signals_raise():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert procs.exit_code(KeyboardInterrupt()) == 130 and procs.describe(KeyboardInterrupt()) == \
        "interrupted (SIGINT)"


def test_a_second_signal_during_the_cleanup_is_ignored():
    cleaned = []
    with pytest.raises(procs.Terminated):
        with procs.signals_raise():
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(5)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # e.g. timeout's second signal: the cleanup goes on
                time.sleep(0.2)
                cleaned.append(True)
    assert cleaned == [True]
