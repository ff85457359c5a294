"""held_back.py GO COMMAND...: waits until the file GO exists, then becomes COMMAND (exec keeps the pid), within
300 s (tests/test_elastic.py: a node that exists before the others but joins later)."""
import os
import sys
import time

go, deadline = sys.argv[1], time.monotonic() + 300
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("never told to start")
    time.sleep(0.01)
os.execv(sys.argv[2], sys.argv[2:])
