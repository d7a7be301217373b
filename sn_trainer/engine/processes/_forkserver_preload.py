"""Imported by the fork server alone, before its first fork (see ``launch.warm_up``).

SIGTERM to a job's whole process group, as schedulers send it, must reach the workers and
stop them at a step boundary; the fork server is their parent, and if the signal killed it,
the kernel would kill them at once (PR_SET_PDEATHSIG). So the server ignores SIGTERM; each
worker installs its own handler before it trains, and the server still exits with the
launcher (multiprocessing closes it when the launcher's end of its pipe closes).
"""
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
