"""The worker processes: started from a warm fork server (``forkserver``, ``_forkserver_preload``) or
spawned, watched and torn down (``launch``), stopped on a signal at a step boundary (``signals``),
and the stages a heartbeat names (``stages``)."""
