"""Under torchrun, a rank that found a peer dead waits for the agent to collect it before raising, so
that the agent names the rank that died as the run's root cause.
"""
from __future__ import annotations

import os
import sys
import time

import psutil

# Under torchrun, how long a rank that found a peer dead waits for the agent to collect it (torchrun looks
# every --monitor-interval, 0.1 s by default) before it raises.
AGENT_REAPS_S = 10.0
DYING_S = 1.0  # how long a killed process takes to end, at most


def reaped_by_the_agent(pid: int, message: str) -> None:
    """Say ``message`` on stderr, and return once the parent of dead rank ``pid``, where it is this rank's
    parent too (torchrun's agent), has collected its exit; ``AGENT_REAPS_S`` at most, and ``DYING_S`` where
    the process does not end (a rank that left the group and runs on). The agent stops this rank meanwhile.

    The agent names as the run's root cause the first rank it finds ended (by whole seconds, then by local
    rank): a survivor that raised at once, within milliseconds of the death, could end before the agent's
    next look and be named instead of the rank that died.
    """
    started = time.monotonic()
    try:
        peer = psutil.Process(pid)
        if peer.ppid() != os.getppid():  # not a sibling (another machine's pid, another namespace's)
            return
        print(message, file=sys.stderr, flush=True)
        while True:  # a process's end and its reaping have no event another process can wait on
            waited = time.monotonic() - started
            if waited > AGENT_REAPS_S or (waited > DYING_S and peer.status() != psutil.STATUS_ZOMBIE):
                return
            time.sleep(0.002)
            peer.status()  # raises once it is reaped
    except psutil.Error:  # reaped, or gone
        return

