"""Operations: the demo (`python -m launch.demo`); submitit launches come with their own issue."""
