"""The worker processes: started from a warm fork server (``forkserver``, ``_forkserver_preload``) or
spawned (``spawn``), run to their end, watched and torn down (``supervise``), talking through
cloudpickle and shared-memory handles (``pickling``), stopped on a signal at a step boundary
(``signals``), and the stages a heartbeat names (``stages``)."""
