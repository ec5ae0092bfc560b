"""Operations: jobs on Slurm or local processes, searches, the demo (`python -m launch --help`)."""
import pretrain  # noqa: F401  (first: it sets torch's OpenMP wait policy before torch loads, pretrain/__init__.py)
