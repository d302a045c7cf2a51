"""A metrics server whose process is out of descriptors pauses accepting, and answers once some are free again.

It runs in a child process whose every descriptor is taken by open files, but one for the client's socket: the
server cannot accept the client's connection, which waits; once the files are closed the connection is
accepted and its probe answered.
"""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = r"""
import json, logging, os, resource, socket
from tokcap.cli.metrics_http import Health, MetricsServer

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("tokcap.cli.metrics_http").addHandler(Keep())

server = MetricsServer(lambda: Health(True, "applying"), port=0).start()
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
hogs = []
try:
    while True:
        hogs.append(open(os.devnull))
except OSError:
    pass
hogs.pop().close()
client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
client.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
client.settimeout(0.5)
try:
    early = client.recv(100)
except socket.timeout:
    early = b""
paused = [line for line in warnings if "cannot accept a connection" in line]
for hog in hogs:
    hog.close()
client.settimeout(10)
answer = b""
while chunk := client.recv(4096):
    answer += chunk
client.close()
server.close()
print(json.dumps({"early": early.decode(), "paused": paused, "answer": answer.decode()}))
"""


def test_out_of_descriptors_the_server_pauses_accepting_and_answers_once_they_are_free() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert completed.returncode == 0, completed.stderr
    outcome = json.loads(completed.stdout)
    assert outcome["early"] == ""
    assert outcome["paused"] and "Too many open files" in outcome["paused"][0], outcome
    assert outcome["answer"].startswith("HTTP/1.1 200 "), outcome
