"""The training processes themselves, below DeepSpeed: the process group adopted or started from a launcher's
variables (``process_group``), torchrun's variables set from MPI's for a script run under mpirun (``mpi_env``, run
as ``python -m ds_longseq.processes.mpi_env``), and the peer watchdog that names a dead rank and bounds the hang
(``watchdog``). Import the modules by name: this package's ``__init__`` loads nothing, so ``mpi_env`` starts a
script without importing torch first."""
