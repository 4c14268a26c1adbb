"""`wcache run`'s client and a signal that comes before the template's reply names the
child (the child can already run, and print, then): it must be forwarded once the
relay starts, never kill the client by its default action. In a subprocess: without
the fix the client dies of the signal."""

from __future__ import annotations

import signal
import subprocess
import sys

SCRIPT = r"""
import os, signal, socket, sys, threading
from wcache.store.protocol import recv_frame, send_frame
from wcache.template import client

ours, theirs = socket.socketpair()

def fake_template():
    # the relay forwards the early SIGTERM; the "child" then exits 42, as a handler would
    frame, _ = recv_frame(theirs)
    assert frame == {"op": "signal", "signum": int(signal.SIGTERM)}, frame
    send_frame(theirs, {"op": "exit", "exitcode": 42})

def request(argv, socket_dir):
    threading.Thread(target=fake_template, daemon=True).start()
    os.kill(os.getpid(), signal.SIGTERM)  # the signal lands before the reply is read
    return ours, 12345

client._request = request
sys.exit(client.run_command(["true"], None, fallback=False))
"""


def test_a_signal_before_the_reply_is_forwarded_not_fatal():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 42, (out.returncode, out.stderr)
    assert out.returncode != -signal.SIGTERM


def test_a_refused_request_restores_the_signal_mask_for_the_direct_run():
    """The fallback execs the command directly: it must not start with the forwarded
    signals blocked (the mask survives exec)."""
    script = r"""
import signal, sys
from wcache.template import client
from wcache.template.errors import TemplateMissing

def request(argv, socket_dir):
    raise TemplateMissing("none here")

client._request = request
sys.exit(client.run_command([sys.executable, "-c",
    "import signal; print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"],
    None))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert "running directly" in out.stderr
