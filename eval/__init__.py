"""Evaluation of the exported backbones (`python -m eval --help`)."""
import pretrain  # noqa: F401  (first: it sets torch's OpenMP wait policy before torch loads, pretrain/__init__.py)
