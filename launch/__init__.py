"""Operations: jobs on Slurm or local processes, searches, the demo (`python -m launch --help`).

This package imports nothing heavy itself: a Slurm job unpickles its `launch.jobs.StageJob` before anything handles
the scheduler's signals, and a time-limit warning (SIGUSR2) that lands in that window kills the job with no
checkpoint and no requeue. Unpickling therefore loads only the standard library (0.4 s here against 3-7 s with
torch); torch arrives with the stage, after `StageJob.__call__` holds the signals. The modules that need torch reach
it through `pretrain`, whose __init__ sets OpenMP's wait policy before torch loads."""
