"""What this node is and where it stands, facts the whole house reads (the Trainer, the command
line, the doctor, the launcher, the tuner, checkpoints and the engine): its CPU and instruction sets
(``cpu``), its cores and the CPU time a container allows (``topology``), the allocator and OpenMP
runtimes a worker can run with (``runtime``), and which node of several it is (``cluster``)."""
