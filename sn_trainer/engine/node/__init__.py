"""What this node is and where it stands: its CPU and instruction sets (``machine``), its cores and
the CPU time a container allows (``topology``), the allocator and OpenMP runtimes a worker can
run with (``runtime``), and which node of several it is (``cluster``)."""
