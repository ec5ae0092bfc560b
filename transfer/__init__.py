"""Transfer stages reading RUN_DIR/backbone.pth: fine-tuning and detection (`python -m transfer --help`)."""
import pretrain  # noqa: F401  (first: it sets torch's OpenMP wait policy before torch loads, pretrain/__init__.py)
